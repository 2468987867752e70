"""The whole feature through :class:`Deployment`: settings -> registry, Sessions, publisher,
background reclaimer and backend, against scripted SGLang engines (HTTP push) and scripted vLLM
engines (the vLLM backend), with respx at the HTTP edge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import respx
from agentic_lora_http import HttpPushBackend
from agentic_lora_vllm import VllmBackend

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Versioning
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import Middleware
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.vllm_engine import ScriptedVllmEngine
from tests.session_support import Calls

pytestmark = pytest.mark.asyncio

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)


def _settings(fleet: ScriptedFleet, **kw: Any) -> object:
    return fleet.settings(**kw)


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


async def test_a_deployment_over_pass_through_sessions_is_refused(tmp_path: Path) -> None:
    # Its registry is its Sessions' registry: a pass-through Versioning has none to publish into.
    with ScriptedFleet() as fleet:
        off = load_settings(engines=[f"{e.name}={e.base_url}" for e in fleet.refs])
        versioning = Versioning.from_settings(off)
        backend = HttpPushBackend(str(tmp_path))
        try:
            with pytest.raises(ConfigurationError) as err:
                Deployment(settings=off, versioning=versioning, backend=backend)
            assert err.value.details["check"] == "registry"
        finally:
            await backend.aclose()
            await versioning.aclose()


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
        # No round failed on a registry that was already closed (nothing logged an error).
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        states = {v.version_id: v.state for v in d.registry.core.status().versions}  # type: ignore[attr-defined]
        assert states["A"] in (VersionState.RETIRED, VersionState.RECLAIMED)


# --- vLLM ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def vllm_fleet() -> Iterator[dict[str, ScriptedVllmEngine]]:
    engines = {
        name: ScriptedVllmEngine(name, f"http://127.0.0.1:{32000 + i}")
        for i, name in enumerate(("e0", "e1"))
    }
    with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
        for engine in engines.values():
            engine.mount(router)
        yield engines


def _vllm_settings(engines: dict[str, ScriptedVllmEngine]) -> AgenticLoRASettings:
    return load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{e.name}={e.base_url}" for e in engines.values()],
        capacity=2,
        http_transport="httpx",
        base_model_name="base-model",
        engine_kind="vllm",
        backend="vllm",
    )


class RouteLog:
    """A framework middleware recording the routes it passes on."""

    def __init__(self, next_dispatch: Dispatch, *, log: list[str]) -> None:
        self._next, self._log = next_dispatch, log

    async def __call__(self, call: EngineCall) -> EngineReply:
        self._log.append(call.route.value)
        return await self._next(call)


async def test_on_vllm_old_sessions_keep_a_new_ones_get_b_by_model_name(tmp_path: Path) -> None:
    routes: list[str] = []
    extra_drained: list[str] = []

    async def extra_drain(lora_name: str) -> None:
        extra_drained.append(lora_name)

    with vllm_fleet() as engines:
        async with Deployment.from_settings(
            _vllm_settings(engines),
            backend_options={"store_root": str(tmp_path / "adapters"), "wait_drained": extra_drain},
            middleware=[Middleware(RouteLog, log=routes)],
        ) as d:
            assert isinstance(d.backend, VllmBackend)
            assert (await d.publish("A", A)).outcome is PublicationOutcome.PUBLISHED
            async with d.session("old") as s_old:
                first = await s_old.completions({"prompt": "old: turn 1", "model": "base-model"})
                assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
                async with d.session("new") as s_new:
                    new = await s_new.chat_completions(
                        {"messages": [{"role": "user", "content": "new: turn 1"}]}
                    )
                    tool = await s_old.completions({"prompt": "old: tool turn"})
                    with pytest.raises(InvalidRequestError, match="no /generate"):
                        await s_new.generate({"text": "new: native route"})
            a_name = d.registry.peek_version("A").lora_name  # type: ignore[attr-defined]
            b_name = d.registry.peek_version("B").lora_name  # type: ignore[attr-defined]
            # vLLM answers under the adapter it ran: the replies themselves name the versions.
            assert [r.body["model"] for r in (first, new, tool)] == [a_name, b_name, a_name]
            await d.reclaimer.settled()
            assert d.registry.peek_version("A").state is VersionState.RECLAIMED  # type: ignore[attr-defined]
    for engine in engines.values():
        assert engine.physical_unloads[a_name] == 1
        assert engine.held_digest(b_name) == B.digest
        assert all("lora_path" not in body for body in engine.bodies(EngineOp.COMPLETION))
    assert routes == ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
    # The Deployment's Session drain ran first, then the hook given in backend_options.
    assert extra_drained == [a_name, a_name]


async def test_on_vllm_a_reclaim_waits_for_a_request_still_in_flight_on_the_version(
    tmp_path: Path,
) -> None:
    store = tmp_path / "adapters"
    with vllm_fleet() as engines:
        async with Deployment.from_settings(
            _vllm_settings(engines), backend_options={"store_root": str(store)}
        ) as d:
            await d.publish("A", A)
            s_old = d.versioning.open_session("old")
            first = await s_old.completions({"prompt": "old: turn 1"})
            a_name = first.body["model"]
            await d.publish("B", B)

            gate, reached = asyncio.Event(), asyncio.Event()
            busy = engines[first.engine]
            busy.script(EngineOp.COMPLETION, Fault.waiting_for(gate, reached))
            busy.start_request(a_name)  # the engine reports it running, as vLLM does
            turn = asyncio.create_task(s_old.completions({"prompt": "old: long turn"}))
            try:
                await reached.wait()
                assert d.versioning.in_flight(a_name) == 1
                # The registry drops the Session's ref while its request still runs (as a
                # supervisor releasing a worker's Sessions through a shared registry would): from
                # here only the drain hook stands between the request and vLLM's at-once unload.
                w = Calls(count=2)  # both engines' reclaims wait for it
                d.versioning.on_drain_wait.append(w)
                await d.registry.begin_close(request_id=new_request_id(), session_key=s_old.key)
                await d.registry.release(request_id=new_request_id(), session_key=s_old.key)
                reclaim = asyncio.create_task(d.reclaimer.reclaim_version("A"))
                waiting = asyncio.create_task(w.wait())
                done, _ = await asyncio.wait({reclaim, waiting}, return_when=FIRST_COMPLETED)
                assert done == {waiting}, "the reclaim did not wait for the request in flight"
                assert w.calls == [(a_name, 1), (a_name, 1)]
                assert d.registry.peek_version("A").state is VersionState.RECLAIMING  # type: ignore[attr-defined]
                for engine in engines.values():
                    assert engine.count(EngineOp.UNLOAD) == 0
                    assert (store / engine.name / a_name).is_dir()
            finally:
                busy.finish_request(a_name)
                gate.set()
            reply = await turn
            assert (reply.status_code, reply.body["model"]) == (200, a_name)
            result = await reclaim
            assert result.outcome is ReclaimOutcome.RECLAIMED
            for engine in engines.values():
                assert engine.physical_unloads[a_name] == 1
                assert not (store / engine.name / a_name).exists()
            # A version being reclaimed is never dispatched again, so nothing can reload it.
            sent = busy.count(EngineOp.COMPLETION)
            with pytest.raises(VersionNotDispatchableError):
                await s_old.completions({"prompt": "old: too late"})
            assert busy.count(EngineOp.COMPLETION) == sent


async def test_a_vllm_backend_that_cannot_be_built_opens_nothing_else(tmp_path: Path) -> None:
    with vllm_fleet() as engines, pytest.raises(ConfigurationError, match="absolute"):
        Deployment.from_settings(
            _vllm_settings(engines), backend_options={"store_root": "relative/adapters"}
        )
