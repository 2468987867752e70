"""Bounded staleness at Session granularity (``max_version_lag``), through a real Deployment
(registry, Sessions, publisher, reclaimer, HTTP push) against scripted SGLang engines (respx at
the HTTP edge). Mid-generation publications are gated with events, never timed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import VersionTooStaleError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.provenance import CoreRevision
from agentic_lora.registry.provenance import version_lag
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.registry.ray_actor import RegistryActor
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import VersionState
from agentic_lora.session import Session
from agentic_lora.session import Versioning
from agentic_lora.session.middleware import PeekGuard
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault

pytestmark = pytest.mark.asyncio

A, B, C, D = (tiny_snapshot(i) for i in (1, 2, 3, 4))


def _settings(fleet: ScriptedFleet, *, capacity: int = 2, **kw: Any) -> AgenticLoRASettings:
    return fleet.settings(capacity=capacity, **kw)


@contextlib.asynccontextmanager
async def _deployed(
    tmp_path: Path, *, engines: tuple[str, ...] = ("e0", "e1"), **kw: Any
) -> AsyncIterator[tuple[ScriptedFleet, Deployment]]:
    """A started Deployment over a scripted fleet of ``engines``, with ``kw`` as settings."""
    with ScriptedFleet(engines) as fleet:
        for engine in fleet.engines.values():
            # SGLang keeps one slot unpinned: the engines fit every managed version.
            engine.max_loras_per_batch = kw.get("capacity", 2) + 1
        deployment = Deployment.from_settings(
            _settings(fleet, **kw), backend_options={"store_root": str(tmp_path / "adapters")}
        )
        async with deployment as d:
            yield fleet, d


async def test_lags_up_to_the_bound_are_served_and_one_more_is_refused_before_any_engine_call(
    tmp_path: Path,
) -> None:
    async with _deployed(tmp_path, capacity=4, max_version_lag=2) as (fleet, d):
        assert d.versioning.max_version_lag == 2
        await d.publish("A", A)
        s = d.versioning.open_session("s")
        lags = [(await s.generate({"text": "turn 0"})).provenance]
        for vid, snap in (("B", B), ("C", C)):
            assert (await d.publish(vid, snap)).outcome is PublicationOutcome.PUBLISHED
            lags.append((await s.generate({"text": f"after {vid}"})).provenance)
        assert [p.lag if p else None for p in lags] == [0, 1, 2]
        assert (await d.publish("D", D)).outcome is PublicationOutcome.PUBLISHED

        sent = fleet.calls(EngineOp.GENERATE)
        with pytest.raises(VersionTooStaleError) as err:
            await s.generate({"text": "lag 3"})
        assert err.value.code == "VERSION_TOO_STALE"
        assert err.value.details["lag"] == 3
        assert err.value.details["version"] == "A"
        assert err.value.details["max_version_lag"] == 2
        assert fleet.calls(EngineOp.GENERATE) == sent  # refused before any engine call

        # Sticky, on every route; still bound to A (the version never changes).
        for _attempt in range(2):
            with pytest.raises(VersionTooStaleError):
                await s.chat_completions({"messages": [{"role": "user", "content": "x"}]})
        assert fleet.calls(EngineOp.GENERATE) == sent
        assert s.binding is not None
        assert s.binding.version_id == "A"
        record = s.provenance()
        assert (record["lags"], record["turns"], record["too_stale_lag"]) == ([0, 1, 2], 3, 3)

        # It can only be closed, and close releases its ref now.
        released = await s.close()
        assert released is not None
        assert released.released_now
        with pytest.raises(SessionClosedError):
            await s.generate({"text": "after close"})
        # A new Session binds the default and is served.
        async with d.session("fresh") as fresh:
            reply = await fresh.generate({"text": "fresh"})
            assert reply.provenance is not None
            assert (reply.provenance.version_id, reply.provenance.lag) == ("D", 0)


async def test_a_too_stale_session_closed_frees_the_slot_a_skipped_publication_needed(
    tmp_path: Path,
) -> None:
    async with _deployed(tmp_path, capacity=2, max_version_lag=0) as (fleet, d):
        await d.publish("A", A)
        s = d.versioning.open_session("old")
        await s.generate({"text": "turn 0"})
        assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
        # A is retired but held by the Session: no slot for C, nothing transferred.
        loads = fleet.calls(EngineOp.LOAD)
        assert (await d.publish("C", C)).outcome is PublicationOutcome.SKIPPED
        assert fleet.calls(EngineOp.LOAD) == loads
        with pytest.raises(VersionTooStaleError) as err:
            await s.generate({"text": "lag 1"})
        assert err.value.details["lag"] == 1
        # The framework drops the episode: the close releases A, the reclaimer unloads it.
        await s.close()
        await d.reclaimer.settled()
        states = {v.version_id: v.state for v in (await d.status()).versions}
        assert states["A"] is VersionState.RECLAIMED
        assert (await d.publish("C", C)).outcome is PublicationOutcome.PUBLISHED


@contextlib.asynccontextmanager
async def _on_one_engine(
    tmp_path: Path, *, max_version_lag: int
) -> AsyncIterator[tuple[ScriptedFleet, Deployment, Session]]:
    """One engine with room for three versions, A published, Session "s" open (not bound)."""
    async with _deployed(
        tmp_path, capacity=3, max_version_lag=max_version_lag, engines=("e0",)
    ) as (fleet, d):
        await d.publish("A", A)
        yield fleet, d, d.versioning.open_session("s")


async def _held_turn(
    fleet: ScriptedFleet, s: Session
) -> tuple[asyncio.Task[EngineReply], asyncio.Event]:
    """A long turn of ``s``, held on e0 once it got there: the running turn and the gate that
    lets it finish."""
    gate, reached = asyncio.Event(), asyncio.Event()
    fleet["e0"].script(EngineOp.GENERATE, Fault.waiting_for(gate, reached))
    running = asyncio.create_task(s.generate({"text": "long turn"}))
    await reached.wait()
    return running, gate


async def test_a_generation_in_flight_is_never_cut_by_publications_that_land_meanwhile(
    tmp_path: Path,
) -> None:
    async with _on_one_engine(tmp_path, max_version_lag=1) as (fleet, d, s):
        running, gate = await _held_turn(fleet, s)
        # Two publications commit while the generation runs: lag 2 > 1 from here on.
        assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
        assert (await d.publish("C", C)).outcome is PublicationOutcome.PUBLISHED
        assert not running.done()
        gate.set()
        reply = await running
        assert reply.status_code == 200
        assert reply.body["meta_info"]["lora_path"] == s.binding.lora_name  # type: ignore[union-attr]
        assert reply.provenance is not None
        assert reply.provenance.lag == 0
        sent = fleet.calls(EngineOp.GENERATE)
        with pytest.raises(VersionTooStaleError) as err:
            await s.generate({"text": "next turn"})
        assert err.value.details["lag"] == 2
        assert fleet.calls(EngineOp.GENERATE) == sent
        assert s.provenance()["lags"] == [0]
        await s.close()


async def test_a_concurrent_turn_refused_as_stale_does_not_cut_the_one_running(
    tmp_path: Path,
) -> None:
    async with _on_one_engine(tmp_path, max_version_lag=0) as (fleet, d, s):
        await s.generate({"text": "bind"})
        running, gate = await _held_turn(fleet, s)
        await d.publish("B", B)
        with pytest.raises(VersionTooStaleError):
            await s.generate({"text": "parallel tool turn"})
        assert s.in_flight == 1
        gate.set()
        assert (await running).status_code == 200
        assert s.provenance()["lags"] == [0, 0]
        await s.close()


async def test_off_by_default_a_session_is_served_at_any_lag(tmp_path: Path) -> None:
    async with _deployed(tmp_path, capacity=3) as (fleet, d):
        assert _settings(fleet).max_version_lag is None
        assert d.versioning.max_version_lag is None
        await d.publish("A", A)
        async with d.session("s") as s:
            await s.generate({"text": "turn 0"})
            await d.publish("B", B)
            await d.publish("C", C)
            reply = await s.generate({"text": "turn 1"})
            assert reply.provenance is not None
            assert (reply.provenance.version_id, reply.provenance.lag) == ("A", 2)
            assert s.provenance()["too_stale_lag"] is None


async def test_the_lag_is_read_without_a_registry_round_trip(tmp_path: Path) -> None:
    async with _deployed(tmp_path, max_version_lag=1) as (_, d):
        await d.publish("A", A)
        registry = d.registry
        assert isinstance(registry, LocalRegistry)
        changes: list[str] = []
        registry.add_listener(lambda verb, _result: changes.append(verb))
        async with d.session("s") as s:
            await s.generate({"text": "bind"})
            before = list(changes)
            for _ in range(3):
                await s.generate({"text": "turn"})
            assert changes == before  # no registry verb per dispatch


async def test_bad_bounds_are_configuration_errors(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        with pytest.raises(ConfigurationError) as err:
            _settings(fleet, max_version_lag=-1)
        assert err.value.details["check"] == "max_version_lag"
        registry = LocalRegistry(engines=["e0", "e1"], capacity=2)
        transport = EngineTransport(fleet.refs, http_transport="httpx")
        try:
            for bad in (-1, True, 1.5):
                with pytest.raises(ConfigurationError) as err:
                    Versioning(
                        transport=transport,
                        registry=registry,
                        max_version_lag=bad,  # type: ignore[arg-type]
                    )
                assert err.value.details["check"] == "max_version_lag"
            with pytest.raises(ConfigurationError) as err:
                Versioning(transport=transport, enabled=False, max_version_lag=1)
            assert err.value.details["check"] == "max_version_lag"
            # A registry that cannot say the current default revision without I/O cannot
            # enforce a bound; without a bound its Sessions simply report no lag.
            opaque: Any = _OpaqueRegistry()
            with pytest.raises(ConfigurationError) as err:
                Versioning(
                    transport=transport,
                    registry=opaque,
                    guard=PeekGuard(lambda _v: None),
                    max_version_lag=1,
                )
            assert err.value.details["check"] == "max_version_lag"
            given = Versioning(
                transport=transport,
                registry=opaque,
                guard=PeekGuard(lambda _v: None),
                max_version_lag=0,
                revision_reader=CoreRevision(registry.core),
            )
            assert given.max_version_lag == 0
            # The flag off: the setting is ignored (pass-through Sessions bind nothing).
            off = Versioning.from_settings(
                load_settings(
                    engines=[f"{e.name}={e.base_url}" for e in fleet.refs], max_version_lag=3
                ),
                transport=transport,
            )
            assert off.max_version_lag is None
            s = off.open_session("plain")
            assert s.provenance()["version_id"] is None
        finally:
            await transport.aclose()
            await registry.aclose()


class _OpaqueRegistry:
    """Only stands for "some RegistryAPI that is neither local nor a revision reader"."""


async def test_a_lag_is_never_negative_and_unknown_without_a_revision() -> None:
    b = Binding(
        "s", VersionRef("A", "0" * 64, "policy_lora@0-A-" + "0" * 16, 1), default_revision=5
    )
    assert version_lag(b, None) is None
    assert version_lag(b, 4) == 0  # an older cached revision than the bind's reads as 0
    assert version_lag(b, 8) == 3


# --- the Ray client's cached revision ----------------------------------------------------------


class _Method:
    """A Ray actor method handle: ``.remote(...)`` returns an awaitable (the in-process actor)."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class _Handle:
    def __init__(self, actor: RegistryActor) -> None:
        self.call = _Method(actor.call)
        self.call_batch = _Method(actor.call_batch)
        self.read = _Method(actor.read)
        self.start = _Method(actor.start)


async def test_a_ray_client_reads_a_cached_revision_that_can_only_under_estimate_a_lag(
    tmp_path: Path,
) -> None:
    actor = RegistryActor({"engines": ["e0", "e1"], "capacity": 2})
    trainer = RayRegistryClient(_Handle(actor))  # the publisher's process
    worker = RayRegistryClient(_Handle(actor))  # a rollout worker's process
    assert trainer.default_revision() is None  # nothing seen yet: lags unknown
    with ScriptedFleet() as fleet:
        settings = _settings(fleet, max_version_lag=0)
        async with Deployment.from_settings(
            settings,
            registry=trainer,
            backend_options={"store_root": str(tmp_path / "adapters")},
        ) as d:
            await d.publish("A", A)
            assert trainer.default_revision() == 1  # seen on the commit reply
            workers = Versioning.from_settings(settings, registry=worker)
            try:
                s = workers.open_session("w")
                first = await s.generate({"text": "bind"})
                assert worker.default_revision() == 1  # seen on the bind reply
                assert first.provenance is not None
                assert first.provenance.lag == 0
                await d.publish("B", B)
                assert trainer.default_revision() == 2
                # The worker's cache has not seen B's commit yet: the lag reads 0, one turn
                # past the bound (under-estimated, never over-estimated).
                late = await s.generate({"text": "before refresh"})
                assert late.provenance is not None
                assert late.provenance.lag == 0
                await worker.refresh()  # what start_refresh does every interval
                assert worker.default_revision() == 2
                with pytest.raises(VersionTooStaleError) as err:
                    await s.generate({"text": "after refresh"})
                assert err.value.details["lag"] == 1
                await s.close()
            finally:
                await workers.aclose()
    await actor.flush()
    json.dumps(s.provenance())


async def test_a_rollout_worker_without_a_gateway_exposes_the_lag_metrics(tmp_path: Path) -> None:
    # The recipe of docs/staleness.md#metrics: a Metrics watching the worker's own Versioning.
    from prometheus_client.parser import text_string_to_metric_families

    from agentic_lora.assembly.metrics import Metrics

    async with _deployed(tmp_path, capacity=3, max_version_lag=0) as (_, d):
        metrics = Metrics()
        metrics.watch_staleness(d.versioning)
        await d.publish("A", A)
        s = d.versioning.open_session("worker-episode")
        await s.generate({"text": "lag 0"})
        await d.publish("B", B)
        with pytest.raises(VersionTooStaleError):
            await s.generate({"text": "lag 1"})
        await s.close()
    samples = {
        (sample.name, sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for sample in family.samples
    }
    assert samples[("agentic_lora_session_version_lag_count", None)] == 2
    assert samples[("agentic_lora_session_version_lag_bucket", "0.0")] == 1
    assert samples[("agentic_lora_version_too_stale_refusals_total", None)] == 1
