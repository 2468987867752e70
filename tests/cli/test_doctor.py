"""``agentic-lora doctor`` against scripted engines: the LoRA and slot rules of start-up, the
served model, an adapter's rank and modules, the router's retries and the store root.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agentic_lora import cli
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from tests.cli.support import assert_one_error_line
from tests.cli.support import fleet_config
from tests.cli.support import only_line
from tests.cli.support import run_cli
from tests.cli.support import run_script
from tests.cli.support import scripted_fleet_config
from tests.gateway.test_gateway import lora_server_info


async def doctor(
    tmp_path: Path, *flags: str, info: Mapping[str, Any] | None = None, **config: Any
) -> tuple[int, str, str]:
    """``agentic-lora doctor`` on a config of two scripted engines whose server info carries
    ``info`` (over :func:`lora_server_info`'s healthy fields); ``config`` as ``write_config`` takes it."""
    with ScriptedFleet() as fleet:
        lora_server_info(fleet, **(info or {}))
        path = scripted_fleet_config(tmp_path / "c.toml", fleet, **config)
        return await run_cli("doctor", "--config", str(path), *flags)


def test_doctor_with_unreachable_engines_names_them_and_fails(tmp_path: Path) -> None:
    config = fleet_config(tmp_path / "c.toml")
    proc = run_script("doctor", "--config", str(config), cwd=tmp_path)
    assert_one_error_line(proc, "CONFIG_ERROR")
    for engine in ("e0", "e1"):
        assert f"{engine}\n  FAIL  reachable       {engine} server_info: Connect" in proc.stdout


@pytest.mark.asyncio
async def test_doctor_catches_an_engine_with_too_few_slots(tmp_path: Path) -> None:
    code, out, err = await doctor(tmp_path, info={"max_loaded_loras": 2})
    assert code == cli.EXIT_ERROR
    # The rule serve enforces at start-up (config.check_engine_server_info), once per engine.
    assert (
        "  FAIL  lora settings   engine e0: max_loaded_loras 2 < capacity + 1 = 3 (every "
        "managed version plus one free slot)" in out
    )
    assert out.count("FAIL") == 2
    assert err.count("\n") == 1
    assert err.startswith("error: CONFIG_ERROR: doctor found 2 problem(s); first: e0 lora settings")


@pytest.mark.asyncio
async def test_doctor_passes_a_healthy_fleet_and_checks_an_adapter_against_it(
    tmp_path: Path,
) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    tiny_snapshot(1, rank=4).write_peft_dir(small)
    tiny_snapshot(1, rank=16).write_peft_dir(large)
    store = {"store_root": str(tmp_path)}
    code, out, err = await doctor(tmp_path, "--adapter", str(small), backend_options=store)
    assert (code, err) == (0, ""), out
    assert out.strip().endswith("all checks passed")
    assert "  ok    max lora rank   adapter rank 4 <= max_lora_rank 8" in out
    assert "  skip  retries off     no gateway_url" in out
    assert f"  ok    store root      {tmp_path} is writable" in out

    code, out, err = await doctor(
        tmp_path, "--adapter", str(large), "--json", backend_options=store
    )
    assert code == cli.EXIT_ERROR
    checks = json.loads(out)
    failed = {(c["scope"], c["name"]) for c in checks if c["status"] == "fail"}
    assert failed == {("e0", "max lora rank"), ("e1", "max lora rank")}


@pytest.mark.asyncio
async def test_doctor_reports_a_router_whose_retries_are_not_asserted_off(tmp_path: Path) -> None:
    code, out, _ = await doctor(
        tmp_path,
        "--json",
        info={"enable_lora": False},
        settings={"gateway_url": "http://127.0.0.1:29000"},
    )
    assert code == cli.EXIT_ERROR
    failed = {
        (c["scope"], c["name"]): c["detail"] for c in json.loads(out) if c["status"] == "fail"
    }
    assert set(failed) == {
        ("config", "settings"),
        ("e0", "lora settings"),
        ("e1", "lora settings"),
        ("router", "retries off"),
    }
    assert "--disable-retries" in failed["router", "retries off"]
    assert failed["e0", "lora settings"].startswith("engine e0 runs without --enable-lora")


@pytest.mark.asyncio
async def test_doctor_still_checks_engines_with_invalid_settings_and_skips_the_unreported(
    tmp_path: Path,
) -> None:
    adapter = tmp_path / "adapter"
    tiny_snapshot(1).write_peft_dir(adapter)
    with ScriptedFleet() as fleet:
        lora_server_info(fleet, max_loaded_loras=None, max_loras_per_batch=None, max_lora_rank=None)
        config = tmp_path / "c.json"
        engines = [f"{e.name}={e.base_url}" for e in fleet.refs]
        config.write_text(json.dumps({"engines": engines, "capacity": 2}))  # no base_model_name
        code, out, err = await run_cli("doctor", "--config", str(config), "--adapter", str(adapter))
    # Without base_model_name the settings are invalid; the engines are checked anyway.
    assert code == cli.EXIT_ERROR
    assert out.startswith("config\n  FAIL  settings        base_model_name None must be the served")
    assert only_line(err).startswith(
        "error: CONFIG_ERROR: doctor found 1 problem(s); first: config"
    )
    e0 = out.split("e0\n", 1)[1].split("e1\n", 1)[0].splitlines()
    assert e0 == [
        "  ok    reachable       SGLang 0.5.23 serving base-model",
        "  ok    lora settings   LoRA on; slot counts not reported; capacity 2",
        "  skip  served model    base_model_name is not set",
        "  skip  max lora rank   max_lora_rank not reported; cannot check the adapter",
        "  ok    target modules  adapter targets are served",
    ]
    assert out.endswith(
        "router\n  skip  retries off     no gateway_url: engines are reached directly\n"
    )


@pytest.mark.asyncio
async def test_doctor_flags_declared_slots_the_engines_do_not_run_with(tmp_path: Path) -> None:
    code, out, err = await doctor(
        tmp_path,
        "--json",
        info={"max_loaded_loras": 4, "max_loras_per_batch": 3},
        settings={
            "engine_max_loaded_loras": 5,
            "engine_max_loras_per_batch": 3,
            "gateway_url": "http://127.0.0.1:29000",
            "gateway_retries_disabled": True,
        },
    )
    assert code == cli.EXIT_ERROR
    checks = json.loads(out)
    failed = [(c["scope"], c["name"], c["detail"]) for c in checks if c["status"] == "fail"]
    assert failed == [
        ("e0", "lora settings", "engine e0 runs with max_loaded_loras=4, settings say 5"),
        ("e1", "lora settings", "engine e1 runs with max_loaded_loras=4, settings say 5"),
    ]
    router = [c for c in checks if c["scope"] == "router"]
    assert router == [
        {
            "scope": "router",
            "name": "retries off",
            "status": "ok",
            "detail": "http://127.0.0.1:29000: asserted to run with --disable-retries",
        }
    ]
    assert only_line(err) == (
        "error: CONFIG_ERROR: doctor found 2 problem(s); first: e0 lora settings: engine e0 "
        "runs with max_loaded_loras=4, settings say 5"
    )


@pytest.mark.asyncio
async def test_doctor_fails_a_store_root_that_is_not_a_writable_directory(tmp_path: Path) -> None:
    occupied = tmp_path / "a-file"
    occupied.write_text("")
    code, out, _ = await doctor(tmp_path, backend_options={"store_root": str(occupied / "store")})
    assert code == cli.EXIT_ERROR
    assert (
        f"backend\n  FAIL  store root      {occupied / 'store'} is not a writable directory" in out
    )
