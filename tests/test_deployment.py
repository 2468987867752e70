"""The whole feature through :class:`Deployment`: settings -> registry, Sessions, publisher,
background reclaimer and HTTP push, against scripted SGLang engines (respx at the HTTP edge)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_lora.config import load_settings
from agentic_lora.deployment import Deployment
from agentic_lora.errors import ConfigurationError
from agentic_lora.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp

pytestmark = pytest.mark.asyncio

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)


def _settings(fleet: ScriptedFleet, **kw: object) -> object:
    return load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{e.name}={e.base_url}" for e in fleet.refs],
        capacity=2,
        http_transport="httpx",  # respx intercepts httpx's default transport
        engine_max_loaded_loras=3,
        engine_max_loras_per_batch=3,
        base_model_name="tiny-qwen3",
        **kw,
    )


def _sent_adapters(fleet: ScriptedFleet, session_marker: str) -> set[str]:
    names: set[str] = set()
    for engine in fleet.engines.values():
        for op, body in engine.calls:
            if op is EngineOp.GENERATE and str(body.get("text", "")).startswith(session_marker):
                names.add(body["lora_path"])
    return names


async def test_old_sessions_keep_a_new_ones_get_b_and_a_is_reclaimed_after_release(
    tmp_path: Path,
) -> None:
    with ScriptedFleet() as fleet:
        settings = _settings(fleet)
        async with Deployment.from_settings(
            settings,  # type: ignore[arg-type]
            backend_options={"store_root": str(tmp_path / "adapters")},
        ) as d:
            assert (await d.publish("A", A)).outcome is PublicationOutcome.PUBLISHED
            async with d.session("old") as s_old:
                await s_old.generate({"text": "old: turn 1"})
                assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
                async with d.session("new") as s_new:
                    await s_new.generate({"text": "new: turn 1"})
                    await s_old.generate({"text": "old: tool turn"})
                    # A is retired but bound, B is the default: C must wait, with no engine call.
                    loads = fleet.calls(EngineOp.LOAD)
                    skipped = await d.publish("C", C)
                    assert skipped.outcome is PublicationOutcome.SKIPPED
                    assert fleet.calls(EngineOp.LOAD) == loads
            # Both Sessions closed: the background reclaimer unloads A once per engine.
            await d.reclaimer.settled()
            status = await d.status()
            states = {v.version_id: v.state for v in status.versions}
            assert states["A"] is VersionState.RECLAIMED
            for engine in fleet.engines.values():
                assert engine.count(EngineOp.UNLOAD) == 1
            assert (await d.publish("C", C)).outcome is PublicationOutcome.PUBLISHED
            a_name = d.registry.peek_version("A").lora_name  # type: ignore[attr-defined]
            b_name = d.registry.peek_version("B").lora_name  # type: ignore[attr-defined]
    assert _sent_adapters(fleet, "old") == {a_name}
    assert _sent_adapters(fleet, "new") == {b_name}


async def test_a_deployment_needs_the_flag_on(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        off = load_settings(engines=[f"{e.name}={e.base_url}" for e in fleet.refs])
        with pytest.raises(ConfigurationError) as err:
            Deployment.from_settings(off, backend_options={"store_root": str(tmp_path)})
        assert err.value.details["check"] == "flag"


async def test_closing_stops_the_reclaimer_before_the_registry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ScriptedFleet() as fleet:
        d = Deployment.from_settings(
            _settings(fleet),  # type: ignore[arg-type]
            backend_options={"store_root": str(tmp_path / "adapters")},
        )
        await d.start()
        await d.publish("A", A)
        s = d.versioning.open_session("old")
        await s.generate({"text": "old: turn"})
        await d.publish("B", B)
        # Closing with a live Session on A: its release pokes the reclaimer, which must finish
        # (or be stopped) while the registry can still record what the engines did.
        await d.aclose()
        assert s.phase.value == "CLOSED"
        assert not [r for r in caplog.records if "registry is closed" in r.getMessage()]
        states = {v.version_id: v.state for v in d.registry.core.status().versions}  # type: ignore[attr-defined]
        assert states["A"] in (VersionState.RETIRED, VersionState.RECLAIMED)
