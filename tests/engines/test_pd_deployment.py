"""PD groups through a Deployment (issue 15, rule 3.3-4): publication, dispatch, repair and
reclaim on every role server of a group.

Scripted prefill and decode SGLang engines behind a scripted SGLang PD router (respx at the
HTTP edge); the real registry, Deployment, HTTP push backend, repairer and reclaimer run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import VersionUnavailableError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.pd_fleet import ScriptedPDFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.engines.test_pd import ROLES

pytestmark = pytest.mark.asyncio

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)


# --- rule 3.3-4: publication, dispatch and reclaim on every role, through a Deployment ----------


def _settings(fleet: ScriptedPDFleet, **kw: Any) -> AgenticLoRASettings:
    values: dict[str, Any] = {
        "enable_versioned_lora_publication": True,
        "capacity": 2,
        "http_transport": "httpx",  # respx intercepts httpx's default transport
        "engine_max_loaded_loras": 3,
        "engine_max_loras_per_batch": 3,
        "base_model_name": "tiny-qwen3",
        "gateway_retries_disabled": True,
        **fleet.settings_values(),
    }
    values.update(kw)
    return load_settings(**values)


async def _deployment(fleet: ScriptedPDFleet, tmp_path: Path) -> AsyncIterator[Deployment]:
    d = Deployment.from_settings(
        _settings(fleet), backend_options={"store_root": str(tmp_path / "adapters")}
    )
    try:
        yield d
    finally:
        await d.aclose()


@pytest.fixture
def fleet() -> Iterator[ScriptedPDFleet]:
    """One PD group (prefill + two decode servers) and nothing else."""
    with ScriptedPDFleet(groups=[("g1", 2)]) as fleet:
        yield fleet


@pytest_asyncio.fixture
async def d(fleet: ScriptedPDFleet, tmp_path: Path) -> AsyncIterator[Deployment]:
    """The Deployment on ``fleet``, background loops off."""
    async for d in _deployment(fleet, tmp_path):
        yield d


@pytest_asyncio.fixture
async def a_name(d: Deployment) -> str:
    """Publishes A on the PD group; A's adapter name."""
    await d.publish("A", A)
    return str(_peek(d, "A").lora_name)


def _peek(d: Deployment, version_id: str) -> Any:
    """The registry's version status, read without I/O (the in-process registry)."""
    return d.registry.peek_version(version_id)  # type: ignore[attr-defined]


def _generated(fleet: ScriptedPDFleet, name: str) -> list[Any]:
    """The adapters of the Sessions' requests a role server got through its PD router (the
    backend's own load probes carry no bootstrap room)."""
    return [
        b.get("lora_path") for b in fleet[name].bodies(EngineOp.GENERATE) if "bootstrap_room" in b
    ]


async def test_publish_loads_every_role_server_pinned_and_dispatch_carries_the_exact_adapter(
    fleet: ScriptedPDFleet, d: Deployment
) -> None:
    result = await d.publish("A", A)
    assert result.outcome is PublicationOutcome.PUBLISHED
    status = _peek(d, "A")
    assert status.ready_engines == ROLES
    incarnations = {e.engine for e in (await d.status()).engines}
    assert incarnations == set(ROLES)  # each role server's incarnation is recorded
    for name in ROLES:
        assert fleet[name].physical_loads[status.lora_name] == 1
        assert fleet[name].adapters[status.lora_name].pinned
    async with d.session("s") as s:
        await s.generate({"text": "turn 1"})
        await s.generate({"text": "turn 2"})
    router = fleet.pd_routers["g1"]
    assert [b["lora_path"] for b in router.generates] == [status.lora_name] * 2
    assert _generated(fleet, "g1.prefill") == [status.lora_name] * 2
    # The router spreads decodes; each decode got the exact adapter it holds.
    assert _generated(fleet, "g1.decode0") == [status.lora_name]
    assert _generated(fleet, "g1.decode1") == [status.lora_name]


async def test_a_failure_on_one_role_fails_the_publication_cleanly_on_every_role(
    fleet: ScriptedPDFleet, d: Deployment
) -> None:
    assert (await d.publish("A", A)).outcome is PublicationOutcome.PUBLISHED
    fleet["g1.decode1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE))
    result = await d.publish("B", B)
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    b_name = _peek(d, "B").lora_name
    for name in ROLES:
        assert not fleet[name].holds(b_name), name
    # The default never moved: a new Session still gets A on both roles.
    a_name = _peek(d, "A").lora_name
    async with d.session("s") as s:
        await s.generate({"text": "turn"})
    assert _generated(fleet, "g1.prefill") == [a_name]


async def test_no_request_reaches_a_group_while_one_role_lacks_the_version(
    fleet: ScriptedPDFleet, d: Deployment, a_name: str
) -> None:
    async with d.session("s") as s:
        await s.generate({"text": "before"})
        fleet["g1.decode1"].restart()  # this decode server holds nothing now
        probe = await d.repairer.probe_once()
        assert probe.restarted == ("g1.decode1",)
        assert _peek(d, "A").ready_engines == ROLES[:2]
        sent = len(fleet.pd_routers["g1"].generates)
        with pytest.raises(VersionUnavailableError) as err:
            await s.generate({"text": "while a decode lacks it"})
        assert err.value.details["lacking"] == ["g1"]
        assert len(fleet.pd_routers["g1"].generates) == sent  # nothing was dispatched
        # The repairer loads A onto the restarted role server again; then the group serves.
        report = await d.repairer.repair_once()
        assert ("A", "g1.decode1") in report.repaired
        assert fleet["g1.decode1"].holds(a_name)
        await s.generate({"text": "after"})
    assert len(fleet.pd_routers["g1"].generates) == sent + 1
    assert fleet.pd_routers["g1"].generates[-1]["lora_path"] == a_name


async def test_a_plain_engine_serves_while_the_group_lacks_the_version(tmp_path: Path) -> None:
    with ScriptedPDFleet(plain=["e0"], groups=[("g1", 1)]) as fleet:
        async for d in _deployment(fleet, tmp_path):
            await d.publish("A", A)
            fleet["g1.prefill"].restart()
            await d.repairer.probe_once()
            sent = len(fleet.pd_routers["g1"].generates)
            async with d.session("s") as s:
                await s.generate({"text": "turn"})
            assert len(fleet.pd_routers["g1"].generates) == sent
            turns = [b for b in fleet["e0"].bodies(EngineOp.GENERATE) if b.get("text") == "turn"]
            assert len(turns) == 1


async def test_a_role_server_that_does_not_answer_takes_its_group_out_of_routing(
    tmp_path: Path,
) -> None:
    with ScriptedPDFleet(plain=["e0"], groups=[("g1", 2)]) as fleet:
        async for d in _deployment(fleet, tmp_path):
            await d.publish("A", A)
            fleet["g1.decode1"].script(EngineOp.SERVER_INFO, Fault(FaultKind.UNREACHABLE))
            await d.repairer.probe_once()
            assert d.versioning.health.healthy() == ("e0",)
            async with d.session("s") as s:
                await s.generate({"text": "turn"})
            assert fleet.pd_routers["g1"].generates == []
            await d.repairer.probe_once()  # it answers again, same process: routed to again
            assert d.versioning.health.healthy() == ("e0", "g1")


@pytest.mark.usefixtures("a_name")
async def test_a_refusal_by_the_group_pokes_the_repairer_for_every_role(
    fleet: ScriptedPDFleet, d: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    poked: list[str | None] = []
    poke = d.repairer.poke

    def spy(engine: str | None = None) -> None:  # records, then pokes for real
        poked.append(engine)
        poke(engine)

    monkeypatch.setattr(d.repairer, "poke", spy)
    fleet["g1.prefill"].script(EngineOp.GENERATE, Fault(FaultKind.REFUSE))
    async with d.session("s") as s:
        with pytest.raises(RequestRefusedError):
            await s.generate({"text": "refused"})
    assert poked == list(ROLES)


async def test_reclaim_unloads_every_role_server_after_its_in_flight_requests(
    fleet: ScriptedPDFleet, d: Deployment, a_name: str
) -> None:
    async with d.session("old") as s:
        await s.generate({"text": "on A"})
        await d.publish("B", B)
    # A long request still decoding on A: SGLang's unload waits for it, per server.
    rid = fleet["g1.decode0"].acquire(a_name)
    reclaim = asyncio.create_task(d.reclaim())
    await fleet["g1.decode0"].unload_blocked.wait()
    assert not reclaim.done()
    assert fleet["g1.decode0"].physical_unloads[a_name] == 0
    await fleet["g1.decode0"].release(rid)
    report = await reclaim
    assert [r.outcome for r in report.results] == [ReclaimOutcome.RECLAIMED]
    assert _peek(d, "A").state is VersionState.RECLAIMED
    for name in ROLES:
        assert fleet[name].physical_unloads[a_name] == 1, name
        assert fleet[name].count(EngineOp.UNLOAD) == 1, name


@pytest.mark.usefixtures("a_name")
async def test_capacity_counts_every_role_and_a_full_decode_refuses(
    fleet: ScriptedPDFleet, d: Deployment
) -> None:
    async with d.session("on-a") as s_a:
        await s_a.generate({"text": "a"})
        await d.publish("B", B)
        async with d.session("on-b") as s_b:
            await s_b.generate({"text": "b"})
            # A (retired, bound) and B (default) fill capacity 2: C is refused before any load.
            loads = fleet.calls(EngineOp.LOAD)
            assert (await d.publish("C", C)).outcome is PublicationOutcome.SKIPPED
            assert fleet.calls(EngineOp.LOAD) == loads


async def test_a_decode_server_without_a_free_slot_fails_the_publication(tmp_path: Path) -> None:
    with ScriptedPDFleet(groups=[("g1", 1)]) as fleet:
        async for d in _deployment(fleet, tmp_path):
            await d.publish("A", A)
            # The decode server was started with fewer slots than the settings claim (one
            # pinnable, taken by A): its load of B is refused, so B never becomes READY on the
            # group and is cleaned from the prefill server too.
            fleet["g1.decode0"].max_loras_per_batch = 2
            assert (await d.publish("B", B)).outcome is PublicationOutcome.FAILED_CLEAN
            b_name = _peek(d, "B").lora_name
            prefill = fleet["g1.prefill"]
            assert not prefill.holds(b_name)
            assert prefill.physical_unloads[b_name] == prefill.physical_loads[b_name]
