"""The instruments operators' dashboards and alerts read: dispatch latency by outcome, failed
requests by code, lease expiries, engine health and membership."""

from __future__ import annotations

import contextlib
from collections import deque
from pathlib import Path

import pytest

from agentic_lora.assembly.metrics import Metrics
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import TooManySessionsError
from agentic_lora.foundation.requests import Route
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import new_request_id
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import InFlight
from agentic_lora.session.middleware import build_chain
from agentic_lora.testing.publish import publish_by_verbs
from tests.assembly.test_metrics import parse
from tests.assembly.test_metrics import scrape
from tests.assembly.test_metrics import value
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import gateway_stack
from tests.gateway.test_ui_view import Member
from tests.gateway.test_ui_view import MemberRow
from tests.gateway.test_ui_view import StatusWithMembers
from tests.gateway.test_ui_view import fleet_status
from tests.gateway.test_ui_view import vars_of

HIST = "agentic_lora_dispatch_seconds"


class Ticks:
    """A clock that moves only by the steps a test scripts: one step per reading pair."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = deque(durations)
        self.now = 0.0
        self.started = False

    def __call__(self) -> float:
        if self.started:
            self.now += self.durations.popleft()
        self.started = not self.started
        return self.now


@pytest.mark.asyncio
async def test_each_dispatch_is_timed_under_its_route_and_outcome() -> None:
    metrics = Metrics()
    script: deque[BaseException | None] = deque(
        [None, None, RequestRefusedError("engine said no", status=400)]
    )

    async def endpoint(call: EngineCall) -> EngineReply:
        failure = script.popleft()
        if failure is not None:
            raise failure
        return EngineReply(engine="e0", path=call.route.value, status_code=200, body={})

    chain = build_chain(endpoint, [metrics.dispatch_middleware(Ticks([0.3, 40.0, 2.0]))])
    for _ in range(3):
        with contextlib.suppress(RequestRefusedError):
            await chain(
                EngineCall(route=Route.CHAT_COMPLETIONS, body={}, ticket=InFlight(rid=None))
            )
    m = parse(metrics.exposition().decode())
    ok = {"route": Route.CHAT_COMPLETIONS.value, "outcome": "ok"}
    refused = {"route": Route.CHAT_COMPLETIONS.value, "outcome": "refused"}
    assert value(m, f"{HIST}_count", **ok) == 2
    assert value(m, f"{HIST}_sum", **ok) == pytest.approx(40.3)
    assert value(m, f"{HIST}_bucket", **ok, le="0.5") == 1
    assert value(m, f"{HIST}_bucket", **ok, le="30.0") == 1
    assert value(m, f"{HIST}_bucket", **ok, le="60.0") == 2
    assert value(m, f"{HIST}_bucket", **refused, le="2.5") == 1
    # Every route and outcome has its series from the start, at zero.
    assert (f"{HIST}_count", frozenset({("route", "/generate"), ("outcome", "indeterminate")})) in m


def test_failed_requests_are_counted_by_whatever_code_they_carry() -> None:
    metrics = Metrics()
    metrics.observe_failed_request(TooManySessionsError("full"))
    metrics.observe_failed_request(TooManySessionsError("full"))
    metrics.observe_failed_request(KeyError("a bug"))
    m = parse(metrics.exposition().decode())
    name = "agentic_lora_gateway_failed_requests_total"
    assert value(m, name, code="TOO_MANY_SESSIONS") == 2
    assert value(m, name, code="AGENTIC_LORA_ERROR") == 1


@pytest.mark.asyncio
async def test_a_gateway_scrape_shows_failed_requests_timed_dispatches_and_engine_health(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        await chat(stack.agent("episode-1"))
        refused = await stack.http().post("/generate", json={"text": "no credential"})
        assert refused.status_code == 401
        m = await scrape(stack)
    failed = "agentic_lora_gateway_failed_requests_total"
    assert value(m, failed, code="ACCESS_DENIED") == 1
    ok = {"route": Route.CHAT_COMPLETIONS.value, "outcome": "ok"}
    assert value(m, f"{HIST}_count", **ok) == 1
    assert value(m, "agentic_lora_engine_up", engine="e0") == 1
    assert value(m, "agentic_lora_engine_up", engine="e1") == 1
    # The registry's membership: both engines ACTIVE, and no series for a state nobody is in.
    assert value(m, "agentic_lora_engine_members", member_state="active") == 2
    assert ("agentic_lora_engine_members", frozenset({("member_state", "ejected")})) not in m


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.asyncio
async def test_lease_expiries_are_counted_from_the_registrys_own_sweep() -> None:
    clock = Clock()
    registry = LocalRegistry(
        engines=("e0", "e1"), capacity=2, clock=clock, sweep_interval=None, name_ttl=100.0
    )
    metrics = Metrics()
    assert metrics.watch_registry(registry)
    await publish_by_verbs(registry, "A", ("e0", "e1"))
    leases = []
    for owner, ttl in (("worker-1", 10.0), ("worker-2", 10.0), ("gateway", 60.0)):
        grant = await registry.open_lease(
            request_id=new_request_id(), owner=owner, incarnation="i", ttl=ttl
        )
        leases.append(grant.lease_id)
    for n, lease in enumerate([leases[0]] * 3 + [leases[1]] * 2 + [leases[2]]):
        await registry.bind_first(request_id=new_request_id(), session_key=f"s{n}", lease=lease)
    clock.t += 11.0
    swept = await registry.sweep_if_due()
    assert swept is not None
    m = parse(metrics.exposition().decode())
    assert value(m, "agentic_lora_leases_expired_total") == 2
    assert value(m, "agentic_lora_lease_expired_sessions_total") == 5
    await registry.aclose()


def _status(*members: MemberRow) -> StatusWithMembers:
    return StatusWithMembers(**vars_of(fleet_status(2, 1)), members=members)


def test_engine_health_and_membership_series_follow_the_fleet() -> None:
    metrics = Metrics()
    metrics.refresh(
        _status(MemberRow("e0", Member.ACTIVE), MemberRow("e1", Member.EJECTED)),
        live_sessions=0,
        engine_health={"e0": True, "e1": False},
    )
    m = parse(metrics.exposition().decode())
    assert value(m, "agentic_lora_engine_up", engine="e0") == 1
    assert ("agentic_lora_engine_up", frozenset({("engine", "e1")})) in m
    assert value(m, "agentic_lora_engine_up", engine="e1") == 0
    assert value(m, "agentic_lora_engine_members", member_state="active") == 1
    assert value(m, "agentic_lora_engine_members", member_state="ejected") == 1
    # e1 left the fleet and nobody is ejected any more: their series go, not linger at a value.
    metrics.refresh(
        _status(MemberRow("e0", Member.ACTIVE)), live_sessions=0, engine_health={"e0": True}
    )
    m = parse(metrics.exposition().decode())
    assert ("agentic_lora_engine_up", frozenset({("engine", "e1")})) not in m
    assert ("agentic_lora_engine_members", frozenset({("member_state", "ejected")})) not in m
    assert value(m, "agentic_lora_engine_members", member_state="active") == 1
