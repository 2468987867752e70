"""PD-disaggregated engines (issue 15): a PD group is one fleet member for routing whose prefill
and decode servers are each an engine for publication, readiness, repair and reclaim.

Scripted prefill and decode SGLang engines behind a scripted SGLang PD router (respx at the
HTTP edge); the real registry, Deployment, HTTP push backend, repairer and reclaimer run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import respx

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import (
    AgenticLoRASettings,
    add_arguments,
    from_args,
    load_settings,
    verify_fleet,
)
from agentic_lora.engines.pd import PDFleet, PDGroup, Role, RoleHealth, check_disaggregation_mode
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import (
    ConfigurationError,
    RequestRefusedError,
    VersionUnavailableError,
)
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.pd_fleet import ScriptedPDFleet
from agentic_lora.testing.sglang_engine import EngineOp, Fault, FaultKind
from tests.config.test_config import check_of as settings_check_of
from tests.config.test_config import on as settings_on

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
GROUP = "g1=prefill=http://p:30000,decode=http://d:30001,decode=http://d:30002,router=http://r:8000"
ROLES = ("g1.prefill", "g1.decode0", "g1.decode1")


def on(**values: Any) -> dict[str, Any]:
    """A valid versioned configuration with one plain engine and one PD group."""
    return settings_on(
        **{
            "engines": ["e0=http://e:30000"],
            "pd_groups": [GROUP],
            "gateway_retries_disabled": True,
            "base_model_name": "tiny-qwen3",
            **values,
        }
    )


def check_of(**values: Any) -> str:
    """The check that refuses :func:`on` with ``values`` changed."""
    return settings_check_of(**on(**values))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("AGENTIC_LORA_")]:
        monkeypatch.delenv(key)


# --- 1. fleet model and configuration; rule 5.2-3: slots on every role ----------------------------


def test_a_pd_group_is_one_member_for_routing_and_its_role_servers_are_engines() -> None:
    s = AgenticLoRASettings(**on())
    assert [e.name for e in s.dispatch_engines] == ["e0", "g1"]
    assert s.dispatch_engines[1].base_url == "http://r:8000"
    assert [e.name for e in s.publication_engines] == ["e0", *ROLES]
    assert [e.base_url for e in s.publication_engines][1:] == [
        "http://p:30000",
        "http://d:30001",
        "http://d:30002",
    ]
    # The mapping form (environment JSON) names the same group.
    mapping = {
        "name": "g1",
        "prefill": "http://p:30000",
        "decode": ["http://d:30001", "http://d:30002"],
        "router": "http://r:8000",
    }
    assert AgenticLoRASettings(**on(pd_groups=[mapping])).pd_groups == s.pd_groups
    # A fleet of PD groups only is a fleet.
    only = AgenticLoRASettings(**on(engines=[]))
    assert [e.name for e in only.dispatch_engines] == ["g1"]


def test_pd_groups_from_the_environment_and_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTIC_LORA_PD_GROUPS", json.dumps([GROUP]))
    monkeypatch.setenv("AGENTIC_LORA_PD_DECODE_MAX_LOADED_LORAS", "4")
    s = AgenticLoRASettings(**{k: v for k, v in on().items() if k != "pd_groups"})
    assert [g.name for g in s.pd_groups] == ["g1"]
    assert s.decode_slots() == (4, 3)
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--versioned-lora-pd-group",
            "g2=prefill=http://p2:1,decode=http://d2:2,router=http://r2:3",
            "--versioned-lora-pd-decode-max-loras-per-batch",
            "5",
        ]
    )
    flagged = from_args(args, **{k: v for k, v in on().items() if k != "pd_groups"})
    assert [g.name for g in flagged.pd_groups] == ["g2"]
    assert flagged.decode_slots() == (4, 5)


@pytest.mark.parametrize(
    ("values", "check"),
    [
        # The decode side needs capacity + 1 slots as well: refused before anything starts.
        ({"pd_decode_max_loaded_loras": 2}, "engine_lora_slots"),
        ({"pd_decode_max_loras_per_batch": 2}, "pinned_slots"),
        (
            {
                "capacity": 3,
                "engine_max_loaded_loras": 4,
                "engine_max_loras_per_batch": 4,
                "pd_decode_max_loras_per_batch": 3,
            },
            "pinned_slots",
        ),
        # The group's PD router retries by default: the operator must assert it does not.
        ({"gateway_retries_disabled": False}, "router_retries"),
        ({"engines": ["g1.prefill=http://x:1"]}, "duplicate_engine"),
        ({"engines": ["g1=http://x:1"]}, "duplicate_engine"),
        ({"engines": ["e0=http://d:30001"]}, "duplicate_engine"),
        ({"pd_groups": [GROUP, GROUP.replace("g1=", "g2=")]}, "duplicate_engine"),
        ({"pd_groups": ["g1=prefill=http://p:1,router=http://r:2"]}, "settings"),
        ({"pd_groups": ["g1=prefill=http://p:1,decode=http://d:2"]}, "settings"),
        ({"pd_groups": ["g.1=prefill=http://p:1,decode=http://d:2,router=http://r:3"]}, "settings"),
        ({"pd_groups": ["g1=prefill=ftp://p:1,decode=http://d:2,router=http://r:3"]}, "settings"),
        ({"pd_groups": ["g1=mixed=http://p:1"]}, "settings"),
        ({"engines": [], "pd_groups": []}, "empty_fleet"),
    ],
)
def test_pd_settings_that_cannot_work_fail_fast(values: dict[str, Any], check: str) -> None:
    assert check_of(**values) == check


def test_decode_slots_default_to_the_engine_slots_and_may_be_larger() -> None:
    assert AgenticLoRASettings(**on()).decode_slots() == (3, 3)
    roomy = AgenticLoRASettings(**on(engine_max_loaded_loras=None, engine_max_loras_per_batch=None))
    assert roomy.decode_slots() == (None, None)  # read from the servers at start-up


def _info(mode: str | None, loaded: int = 3) -> dict[str, Any]:
    info: dict[str, Any] = {
        "enable_lora": True,
        "max_loaded_loras": loaded,
        "max_loras_per_batch": 3,
    }
    if mode is not None:
        info["disaggregation_mode"] = mode
    return info


@pytest.mark.asyncio
async def test_verify_fleet_checks_every_role_server_and_its_role() -> None:
    s = AgenticLoRASettings(**on(engine_max_loaded_loras=None, engine_max_loras_per_batch=None))
    t = EngineTransport(s.dispatch_engines, http_transport="httpx")
    try:
        with respx.mock(assert_all_called=False) as mock:
            mock.get("http://e:30000/server_info").respond(200, json=_info(None))
            prefill = mock.get("http://p:30000/server_info").respond(200, json=_info("prefill"))
            mock.get("http://d:30001/server_info").respond(200, json=_info("decode"))
            decode1 = mock.get("http://d:30002/server_info").respond(
                200, json=_info("decode", loaded=2)
            )
            # A decode server with too few slots would run out under load: refused by name.
            with pytest.raises(ConfigurationError, match=r"g1\.decode1") as err:
                await verify_fleet(s, t)
            assert err.value.details["check"] == "engine_lora_slots"
            decode1.respond(200, json=_info("decode"))
            prefill.respond(200, json=_info("decode"))
            with pytest.raises(ConfigurationError, match=r"g1\.prefill") as err:
                await verify_fleet(s, t)
            assert err.value.details["check"] == "pd_role"
            prefill.respond(200, json=_info("prefill"))
            await verify_fleet(s, t)
            assert decode1.call_count == 2  # the second run stopped at the prefill
    finally:
        await t.aclose()


def test_a_plain_engine_that_runs_disaggregated_is_refused() -> None:
    check_disaggregation_mode({"disaggregation_mode": "null"}, engine="e0", role=Role.PLAIN)
    check_disaggregation_mode({}, engine="g1.decode0", role=Role.DECODE)
    with pytest.raises(ConfigurationError) as err:
        check_disaggregation_mode({"disaggregation_mode": "decode"}, engine="e0", role=Role.PLAIN)
    assert err.value.details["check"] == "pd_role"


def test_a_group_is_dispatchable_only_when_every_role_holds_the_version() -> None:
    fleet = AgenticLoRASettings(**on()).fleet
    assert fleet.dispatchable(["e0", *ROLES]) == ("e0", "g1")
    for missing in ROLES:
        holders = ["e0", *(r for r in ROLES if r != missing)]
        assert fleet.dispatchable(holders) == ("e0",), missing
    assert fleet.dispatchable(ROLES) == ("g1",)
    assert fleet.roles_of("g1") == ROLES
    assert fleet.roles_of("e0") == ("e0",)


def test_role_health_folds_a_role_server_into_its_group() -> None:
    fleet = PDFleet(
        groups=(PDGroup("g1", "http://p:1", ("http://d:2", "http://d:3"), "http://r:4"),)
    )
    members = EngineHealth(["g1"])
    roles = RoleHealth(members, fleet)
    roles.mark_unhealthy("g1.decode0")
    roles.mark_unhealthy("g1.prefill")
    assert members.healthy() == ()
    roles.mark_healthy("g1.decode0")
    assert members.healthy() == ()  # the prefill still does not answer
    roles.mark_healthy("g1.prefill")
    assert members.healthy() == ("g1",)
    # An operator's mark on the group stands: a role coming back does not lift it.
    members.mark_unhealthy("g1")
    roles.mark_unhealthy("g1.decode1")
    roles.mark_healthy("g1.decode1")
    assert members.healthy() == ()


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


@pytest_asyncio.fixture
async def pd(tmp_path: Path) -> AsyncIterator[tuple[ScriptedPDFleet, Deployment]]:
    """One PD group (prefill + two decode servers) and nothing else, background loops off."""
    with ScriptedPDFleet(groups=[("g1", 2)]) as fleet:
        async for d in _deployment(fleet, tmp_path):
            yield fleet, d


@pytest_asyncio.fixture
async def pd_on_a(
    pd: tuple[ScriptedPDFleet, Deployment],
) -> tuple[ScriptedPDFleet, Deployment, str]:
    """The PD group with A published: the fleet, the deployment and A's adapter name."""
    fleet, d = pd
    await d.publish("A", A)
    return fleet, d, _peek(d, "A").lora_name


def _peek(d: Deployment, version_id: str) -> Any:
    """The registry's version status, read without I/O (the in-process registry)."""
    return d.registry.peek_version(version_id)  # type: ignore[attr-defined]


def _generated(fleet: ScriptedPDFleet, name: str) -> list[Any]:
    """The adapters of the Sessions' requests a role server got through its PD router (the
    backend's own load probes carry no bootstrap room)."""
    return [
        b.get("lora_path") for b in fleet[name].bodies(EngineOp.GENERATE) if "bootstrap_room" in b
    ]


@pytest.mark.asyncio
async def test_publish_loads_every_role_server_pinned_and_dispatch_carries_the_exact_adapter(
    pd: tuple[ScriptedPDFleet, Deployment],
) -> None:
    fleet, d = pd
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


@pytest.mark.asyncio
async def test_a_failure_on_one_role_fails_the_publication_cleanly_on_every_role(
    pd: tuple[ScriptedPDFleet, Deployment],
) -> None:
    fleet, d = pd
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


@pytest.mark.asyncio
async def test_no_request_reaches_a_group_while_one_role_lacks_the_version(
    pd_on_a: tuple[ScriptedPDFleet, Deployment, str],
) -> None:
    fleet, d, a_name = pd_on_a
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


@pytest.mark.asyncio
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


@pytest.mark.asyncio
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


@pytest.mark.asyncio
async def test_a_refusal_by_the_group_pokes_the_repairer_for_every_role(
    pd_on_a: tuple[ScriptedPDFleet, Deployment, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet, d, _ = pd_on_a
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


@pytest.mark.asyncio
async def test_reclaim_unloads_every_role_server_after_its_in_flight_requests(
    pd_on_a: tuple[ScriptedPDFleet, Deployment, str],
) -> None:
    fleet, d, a_name = pd_on_a
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


@pytest.mark.asyncio
async def test_capacity_counts_every_role_and_a_full_decode_refuses(
    pd_on_a: tuple[ScriptedPDFleet, Deployment, str],
) -> None:
    fleet, d, _ = pd_on_a
    async with d.session("on-a") as s_a:
        await s_a.generate({"text": "a"})
        await d.publish("B", B)
        async with d.session("on-b") as s_b:
            await s_b.generate({"text": "b"})
            # A (retired, bound) and B (default) fill capacity 2: C is refused before any load.
            loads = fleet.calls(EngineOp.LOAD)
            assert (await d.publish("C", C)).outcome is PublicationOutcome.SKIPPED
            assert fleet.calls(EngineOp.LOAD) == loads


@pytest.mark.asyncio
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
