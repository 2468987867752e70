"""The scenario of scripts/gpu-pd-check.sh, run against a scripted PD group: it drives the real
product end to end and every check it prints passes (the real-engine run needs >= 2 GPUs)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.pd_fleet import ScriptedPDFleet

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_pd_check.py"


def _scenario() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_pd_check", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shell_script_starts_both_roles_and_a_router_without_retries() -> None:
    script = SCRIPT.with_name("gpu-pd-check.sh")
    assert os.access(script, os.X_OK)
    text = script.read_text()
    wanted = (
        "--disaggregation-mode prefill",
        "--disaggregation-mode decode",
        "--pd-disaggregation",
        "--disable-retries",
    )
    assert [flag for flag in wanted if flag not in text] == []


@pytest.mark.asyncio
async def test_the_gpu_pd_scenario_passes_on_a_scripted_pd_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = tiny_snapshot(1).write_peft_dir(tmp_path / "a")
    b = tiny_snapshot(2).write_peft_dir(tmp_path / "b")
    with ScriptedPDFleet(groups=[("g1", 1)]) as fleet:
        args = argparse.Namespace(
            prefill=fleet["g1.prefill"].base_url,
            decode=fleet["g1.decode0"].base_url,
            router=fleet.groups[0].router,
            served_model_name="tiny-qwen3",
            adapter_a=str(a),
            adapter_b=str(b),
            store_root=str(tmp_path / "store"),
            http_transport="httpx",  # respx intercepts httpx's default transport
        )
        status = await _scenario().run(args)
    lines = capsys.readouterr().out.splitlines()
    assert status == 0, lines
    assert not [line for line in lines if line.startswith("FAIL")]
    assert len([line for line in lines if line.startswith("PASS")]) == 13
    # Both role servers were loaded and unloaded through the product, never by the router.
    a_name = next(iter(fleet["g1.prefill"].physical_unloads))
    assert fleet["g1.prefill"].physical_unloads[a_name] == 1
    assert fleet["g1.decode0"].physical_unloads[a_name] == 1
