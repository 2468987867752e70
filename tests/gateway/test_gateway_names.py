"""Durable gateway Session names: a restarted gateway, or another replica on the same registry,
continues an agent's Session on its bound version or refuses it with a typed error; it never binds
a known Session id to a newer version. Closed ids are tombstones in the registry, bounded by age.

Scripted SGLang engines at the HTTP edge (respx); the real journaled registry, Sessions, lease
keeper, publisher, reclaimer and gateway run underneath. A gateway "crash" closes its registry
object (journal written, lock released) without closing a Session, as a killed process leaves it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import TypeVar

import openai
import pytest

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import add_arguments
from agentic_lora.config import from_args
from agentic_lora.config import load_settings
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.errors import SessionStateError
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.sessions import GatewaySessions
from agentic_lora.gateway.sessions import IdleReaped
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import NamedSession
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.verbs import RegistryVerbs
from agentic_lora.session import SessionPhase
from agentic_lora.session import Versioning
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import OpenAIRoutes
from tests.gateway.test_gateway import Stack
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import lora_name
from tests.gateway.test_gateway import served_version
from tests.gateway.test_gateway import settings_for

pytestmark = pytest.mark.asyncio


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def fleet_and_routes() -> AsyncIterator[tuple[ScriptedFleet, OpenAIRoutes]]:
    with ScriptedFleet() as fleet:
        yield fleet, OpenAIRoutes(fleet)


R = TypeVar("R", bound=LocalRegistry)


def shared_registry(fleet: ScriptedFleet, kind: type[R] = LocalRegistry, **options: Any) -> R:
    """A registry on ``fleet``'s engines and capacity, for gateways given it to share."""
    return kind(**settings_for(fleet).registry_identity, **options)


async def start_gateway(
    fleet: ScriptedFleet,
    routes: OpenAIRoutes,
    root: Path,
    *,
    registry: LocalRegistry | None = None,
    gateway_id: str = "gateway",
    clock: Callable[[], float] | None = None,
    reuse_closed_ids: bool = False,
    **settings: Any,
) -> Stack:
    """A started gateway over ``fleet``: its own registry from settings, or ``registry`` shared."""
    values = settings_for(fleet, gateway_id=gateway_id, **settings)
    options: dict[str, Any] = {"admin_token": ADMIN_TOKEN}
    if clock is not None:
        options["clock"] = clock
    reuse = reuse_closed_ids
    if registry is None:
        gateway = await Gateway.from_settings(
            values,
            backend_options={"store_root": str(root / "store")},
            reuse_closed_ids=reuse,
            **options,
        )
    else:
        deployment = Deployment.from_settings(
            values,
            backend_options={"store_root": str(root / "store")},
            registry=registry,
            lease_owner=gateway_id,
            lease_on_restart="adopt",
        )
        gateway = Gateway(deployment, reuse_closed_ids=reuse, owns_deployment=True, **options)
    await gateway.start()
    return Stack(fleet, routes, gateway, root)


@contextlib.asynccontextmanager
async def gateway_on(
    fleet: ScriptedFleet, routes: OpenAIRoutes, root: Path, **options: Any
) -> AsyncIterator[Stack]:
    """:func:`start_gateway`, closed (the gateway, then the clients) when the block ends."""
    stack = await start_gateway(fleet, routes, root, **options)
    try:
        yield stack
    finally:
        await stack.gateway.aclose()
        await stack.aclose_clients()


async def crash(stack: Stack) -> None:
    """Leave ``stack``'s gateway as a kill -9 would: Sessions open, lease unclosed; then close
    its registry object (as the dead process's journal handle and lock go away)."""
    registry: Any = stack.gateway.deployment.registry
    await registry.aclose()


async def bury(stack: Stack) -> None:
    """Free what a crashed gateway's objects still hold in this test process."""
    with contextlib.suppress(SessionReleaseError):
        await stack.gateway.aclose()  # its Sessions cannot be released: the registry is gone
    lease = stack.gateway.versioning.lease
    assert lease is not None
    await lease.aclose()
    await stack.gateway.versioning.transport.aclose()
    await stack.aclose_clients()


@contextlib.asynccontextmanager
async def restarted(first: Stack, **options: Any) -> AsyncIterator[Stack]:
    """Crash ``first`` and start its successor on the same fleet and root (``options`` name the
    journal and the rest); close the successor, then :func:`bury` ``first``."""
    await crash(first)
    try:
        async with gateway_on(first.fleet, first.routes, first.root, **options) as second:
            yield second
    finally:
        await bury(first)


def engine_models(routes: OpenAIRoutes) -> list[str]:
    return routes.models()


# --- a restarted gateway ------------------------------------------------------------------------


async def test_a_restarted_gateway_continues_an_agent_on_its_bound_version(
    tmp_path: Path,
) -> None:
    journal = str(tmp_path / "registry.sqlite")
    async with fleet_and_routes() as (fleet, routes):
        first = await start_gateway(fleet, routes, tmp_path, journal_path=journal)
        await first.publish("A", 1)
        a_name = lora_name(first, "A")
        await chat(first.agent("agent-x"), "turn 1")

        async with restarted(first, journal_path=journal) as second:
            # Its lease opened at start and adopted the predecessor's Session at once.
            assert second.gateway.sessions.adopted() == 1
            assert (await second.publish("B", 2))["outcome"] == "PUBLISHED"
            b_name = lora_name(second, "B")

            assert await served_version(second.agent("agent-x"), "turn 2") == "A"
            assert await served_version(second.agent("agent-y"), "turn 1") == "B"
            # What the engines received, turn by turn: agent x never left A.
            assert engine_models(routes) == [
                f"{BASE_MODEL}:{a_name}",
                f"{BASE_MODEL}:{a_name}",
                f"{BASE_MODEL}:{b_name}",
            ]
            assert second.gateway.sessions.adopted() == 0
            status = await second.gateway.deployment.status()
            refs = {v.version_id: v.session_refs for v in status.versions}
            assert refs == {"A": 1, "B": 1}


async def test_a_closed_id_stays_refused_after_a_restart(tmp_path: Path) -> None:
    journal = str(tmp_path / "registry.sqlite")
    async with fleet_and_routes() as (fleet, routes):
        first = await start_gateway(fleet, routes, tmp_path, journal_path=journal)
        await first.publish("A", 1)
        agent = first.agent("agent-x")
        await chat(agent)
        closed = await first.close_own("agent-x")
        assert closed.json()["found"] is True

        async with restarted(first, journal_path=journal) as second:
            await second.publish("B", 2)
            with pytest.raises(openai.ConflictError) as err:
                await chat(second.agent("agent-x"), "straggler")
            assert err.value.body == {
                "code": "SESSION_CLOSED",
                "message": "session 'agent-x' was closed; start a new Session with a new id",
                "details": {"session": "agent-x", "reason": "closed"},
            }
            assert err.value.response.headers["x-agentic-outcome"] == "refused"
            assert len(routes.sent) == 1  # the straggler reached no engine
            again = await second.close_own("agent-x")
            assert again.json()["found"] is False


async def test_an_adopted_session_whose_agent_never_returns_is_closed_when_idle(
    tmp_path: Path,
) -> None:
    journal = str(tmp_path / "registry.sqlite")
    clock = FakeClock()
    async with fleet_and_routes() as (fleet, routes):
        first = await start_gateway(fleet, routes, tmp_path, journal_path=journal)
        await first.publish("A", 1)
        await chat(first.agent("gone"))

        async with restarted(first, journal_path=journal, clock=clock) as second:
            await second.publish("B", 2)
            sessions = second.gateway.sessions
            assert (sessions.adopted(), sessions.live()) == (1, 1)
            clock.now += 29.0
            assert await sessions.reap_idle(30.0) == IdleReaped()
            clock.now += 1.0
            assert await sessions.reap_idle(30.0) == IdleReaped(
                adopted_tags=(sessions.tag("gone"),)
            )
            assert (sessions.adopted(), sessions.live()) == (0, 0)
            # Its ref is released, so the retired A can be reclaimed; its id is a tombstone.
            report = await second.admin().reclaim()
            assert [r["version_id"] for r in report["results"]] == ["A"]
            refused = await second.http().post(
                "/generate", json={"text": "x"}, headers={"x-agentic-session": "gone"}
            )
            assert refused.status_code == 409
            assert refused.json()["error"]["code"] == "SESSION_CLOSED"


async def test_an_adopted_session_in_use_is_not_reaped_after_a_restart_with_another_tag_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a stable hash key (no admin token, no AGENTIC_LORA_SESSION_HASH_KEY) a restarted
    # gateway tags ids differently from its predecessor, whose tags prefix the adopted keys.
    journal = str(tmp_path / "registry.sqlite")
    clock = FakeClock()
    async with fleet_and_routes() as (fleet, routes):
        monkeypatch.setenv("AGENTIC_LORA_SESSION_HASH_KEY", "the key before the crash")
        first = await start_gateway(fleet, routes, tmp_path, journal_path=journal)
        await first.publish("A", 1)
        await chat(first.agent("agent-x"), "turn 1")

        monkeypatch.setenv("AGENTIC_LORA_SESSION_HASH_KEY", "another key after it")
        async with restarted(first, journal_path=journal, clock=clock) as second:
            sessions = second.gateway.sessions
            assert sessions.adopted() == 1
            await second.publish("B", 2)
            clock.now += 29.0
            assert await served_version(second.agent("agent-x"), "turn 2") == "A"
            # Held under its name again: not an adopted leftover the idle expiry may close.
            assert (sessions.adopted(), sessions.live()) == (0, 1)
            clock.now += 1.0
            assert await sessions.reap_idle(30.0) == IdleReaped()
            assert await served_version(second.agent("agent-x"), "turn 3") == "A"


async def test_reused_ids_survive_a_restart_of_the_same_gateway(tmp_path: Path) -> None:
    journal = str(tmp_path / "registry.sqlite")
    async with fleet_and_routes() as (fleet, routes):
        first = await start_gateway(
            fleet, routes, tmp_path, journal_path=journal, reuse_closed_ids=True
        )
        await first.publish("A", 1)
        worker = first.agent("worker-3")
        await chat(worker, "episode 1")
        await first.close_own("worker-3")
        await first.publish("B", 2)
        assert await served_version(worker, "episode 2") == "B"  # a new lifecycle, on purpose
        b_name = lora_name(first, "B")

        async with restarted(first, journal_path=journal, reuse_closed_ids=True) as second:
            await second.gateway.deployment.reclaimer.settled()
            assert (await second.publish("C", 3))["outcome"] == "PUBLISHED"
            raw = await second.agent("worker-3").chat.completions.with_raw_response.create(
                model=BASE_MODEL, messages=[{"role": "user", "content": "episode 2, turn 2"}]
            )
            # Adopted at the restart: episode 2 stays on B although C is the default.
            assert raw.headers["x-agentic-version"] == "B"
            assert engine_models(routes)[-1] == f"{BASE_MODEL}:{b_name}"


# --- two replicas on one registry ---------------------------------------------------------------


async def test_two_replicas_on_one_registry_agree_on_a_session(tmp_path: Path) -> None:
    async with fleet_and_routes() as (fleet, routes):
        registry = shared_registry(fleet)
        one = await start_gateway(fleet, routes, tmp_path, registry=registry, gateway_id="gw-1")
        await one.publish("A", 1)
        a_name = lora_name(one, "A")
        two = await start_gateway(fleet, routes, tmp_path, registry=registry, gateway_id="gw-2")
        try:
            await chat(one.agent("agent-x"), "on replica 1")
            await one.publish("B", 2)

            # Replica 2 continues it on A (and takes it onto its own lease), new ids get B.
            assert await served_version(two.agent("agent-x"), "on replica 2") == "A"
            named = registry.core.named("agent-x")
            assert named is not None
            assert named.lease is not None
            assert named.lease.startswith("gw-2/")
            assert await served_version(two.agent("agent-y"), "new") == "B"
            # Back on replica 1 (its cached Session): still A.
            assert await served_version(one.agent("agent-x"), "back on replica 1") == "A"
            assert routes.models().count(f"{BASE_MODEL}:{a_name}") == 3

            # Closed on replica 1: refused on replica 2, which holds a cached copy.
            closed = await one.close_own("agent-x")
            assert closed.json()["version_id"] == "A"
            sent = len(routes.sent)
            with pytest.raises(openai.ConflictError) as err:
                await chat(two.agent("agent-x"), "straggler")
            assert err.value.body["code"] == "SESSION_CLOSED"  # type: ignore[index]
            assert len(routes.sent) == sent

            # Opened only on replica 2, closed through replica 1 (which never saw it).
            closed = await one.close_own("agent-y")
            assert closed.json() == {
                "session": "agent-y",
                "found": True,
                "version_id": "B",
                "released_now": True,
            }
            refused = await two.http().post(
                "/generate", json={"text": "x"}, headers={"x-agentic-session": "agent-y"}
            )
            assert refused.status_code == 409
            await asyncio.sleep(0)  # let the local copy's retirement run
            status = await registry.status()
            assert {v.version_id: v.session_refs for v in status.versions} == {"A": 0, "B": 0}
        finally:
            await two.gateway.aclose()
            await one.gateway.aclose()
            await registry.aclose()
            await one.aclose_clients()
            await two.aclose_clients()


async def test_concurrent_first_requests_of_one_id_share_one_registry_session(
    tmp_path: Path,
) -> None:
    async with fleet_and_routes() as (fleet, routes), gateway_on(fleet, routes, tmp_path) as stack:
        sessions = stack.gateway.sessions
        a, b = await asyncio.gather(sessions.open("twin"), sessions.open("twin"))
        assert a is b
        registry: Any = stack.gateway.deployment.registry
        named = registry.core.named("twin")
        assert named is not None
        assert named.session_key == a.key


# --- tombstones are bounded by age ------------------------------------------------------------


async def test_a_tombstone_is_forgotten_after_name_ttl_then_the_id_opens_anew(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with fleet_and_routes() as (fleet, routes):
        registry = shared_registry(fleet, clock=clock, sweep_interval=None, name_ttl=600.0)
        # A lease far longer than the fake time this test skips: only names age here.
        async with (
            contextlib.aclosing(registry),
            gateway_on(
                fleet, routes, tmp_path, registry=registry, lease_ttl=1e6, session_name_ttl=600.0
            ) as stack,
        ):
            await stack.publish("A", 1)
            agent = stack.agent("episode-7")
            await chat(agent)
            await stack.close_own("episode-7")
            await stack.publish("B", 2)

            clock.now += 599.0
            assert await registry.sweep_if_due() is None
            with pytest.raises(openai.ConflictError):
                await chat(agent, "too early")
            clock.now += 1.0
            swept = await registry.sweep_if_due()
            assert swept is not None
            assert swept.forgotten_names == 1
            assert await served_version(agent, "a new lifecycle") == "B"


async def test_session_name_ttl_reaches_the_registry_the_gateway_builds(tmp_path: Path) -> None:
    async with (
        fleet_and_routes() as (fleet, routes),
        gateway_on(fleet, routes, tmp_path, session_name_ttl=0.001) as stack,
    ):
        sessions = stack.gateway.sessions
        await sessions.open("short-lived")
        await sessions.close("short-lived")
        await asyncio.sleep(0.01)  # lets 10 ttls of wall time pass; nothing races
        registry: Any = stack.gateway.deployment.registry
        await registry.sweep_if_due()  # unless the background sweeper did it already
        reopened = await sessions.open("short-lived")
        assert reopened.phase is SessionPhase.OPEN


async def test_ten_thousand_closed_ids_grow_only_the_registry_which_ages_them_out() -> None:
    clock = FakeClock()
    with ScriptedFleet() as fleet:
        settings = settings_for(fleet, lease_ttl=1e6)  # only names age here
        registry = shared_registry(fleet, clock=clock, sweep_interval=None, name_ttl=60.0)
        versioning = Versioning.from_settings(
            settings,
            registry=registry,
            lease_owner="gateway",
            lease_on_restart="adopt",
        )
        sessions = GatewaySessions(versioning, lease=versioning.lease)
        try:
            for i in range(10_000):
                await sessions.open(f"closed-{i}")
                await sessions.close(f"closed-{i}")
            # The gateway process holds nothing per closed id ...
            assert sessions.live() == 0
            assert versioning.live_sessions() == ()
            assert vars(sessions)["_cached"] == {}
            assert vars(sessions)["_opening"] == {}
            # ... the registry holds the tombstones, which refuse every one of those ids ...
            assert registry.core.session_count == 0
            with pytest.raises(AgenticLoRAError) as err:
                await sessions.open("closed-0")
            assert err.value.code == "SESSION_CLOSED"
            # ... until they age out.
            clock.now += 60.0
            swept = await registry.sweep_if_due()
            assert swept is not None
            assert swept.forgotten_names == 10_000
            reopened = await sessions.open("closed-0")
            assert reopened.binding is None
            await sessions.close("closed-0")
        finally:
            await versioning.aclose()
            await registry.aclose()


async def test_closing_an_id_the_registry_never_saw_tombstones_it(tmp_path: Path) -> None:
    async with fleet_and_routes() as (fleet, routes), gateway_on(fleet, routes, tmp_path) as stack:
        await stack.publish("A", 1)
        probes = stack.fleet.calls(EngineOp.GENERATE)  # the publication's own
        http = stack.http()
        closed = await stack.close_own("never-used")
        assert closed.json() == {
            "session": "never-used",
            "found": False,
            "version_id": None,
            "released_now": False,
        }
        # A straggler of that id must not open a fresh Session either.
        refused = await http.post(
            "/generate", json={"text": "x"}, headers={"x-agentic-session": "never-used"}
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "SESSION_CLOSED"
        assert routes.sent == []
        assert stack.fleet.calls(EngineOp.GENERATE) == probes


async def test_a_lease_the_registry_expired_behind_the_gateways_back_is_replaced(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with fleet_and_routes() as (fleet, routes):
        registry = shared_registry(fleet, clock=clock, sweep_interval=None)
        async with (
            contextlib.aclosing(registry),
            gateway_on(fleet, routes, tmp_path, registry=registry, lease_ttl=30.0) as stack,
        ):
            await stack.publish("A", 1)
            await chat(stack.agent("before"))
            lease = stack.gateway.versioning.lease
            assert lease is not None
            old = lease.current.lease_id
            # The registry's clock runs past the TTL (the gateway was partitioned, say); the
            # keeper's own clock did not, so it still believes it holds the lease.
            clock.now += 31.0
            swept = await registry.sweep_if_due()
            assert swept is not None
            assert swept.expired_leases == (old,)
            # The next new id finds out at open_named and opens under a fresh incarnation.
            assert await served_version(stack.agent("after"), "x") == "A"
            assert lease.current.lease_id != old
            named = registry.core.named("after")
            assert named is not None
            assert named.lease == lease.current.lease_id
            # The expired one is refused with a typed error, never re-bound.
            with pytest.raises(openai.ConflictError) as err:
                await chat(stack.agent("before"), "late")
            assert err.value.body["code"] == "SESSION_EXPIRED"  # type: ignore[index]


# --- the registry's answers -----------------------------------------------------------------------


class LosingRegistry(LocalRegistry):
    """A registry whose next ``open_named`` replies are lost after the call was applied."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lose_replies = 0
        self.unreachable = False
        self.request_ids: list[str] = []

    async def open_named(
        self, *, request_id: str, name: str, session_key: str, lease: str | None
    ) -> NamedSession:
        self.request_ids.append(request_id)
        if self.unreachable:
            raise ConnectionError("registry unreachable (scripted)")
        answer = await super().open_named(
            request_id=request_id, name=name, session_key=session_key, lease=lease
        )
        if self.lose_replies:
            self.lose_replies -= 1
            raise ConnectionError("reply lost (scripted)")
        return answer


async def test_a_lost_open_named_reply_is_replayed_with_the_same_request_id(
    tmp_path: Path,
) -> None:
    async with fleet_and_routes() as (fleet, routes):
        registry = shared_registry(fleet, LosingRegistry)
        async with (
            contextlib.aclosing(registry),
            gateway_on(fleet, routes, tmp_path, registry=registry) as stack,
        ):
            await stack.publish("A", 1)
            registry.lose_replies = 2
            reply = await stack.http().post(
                "/generate", json={"text": "x"}, headers={"x-agentic-session": "lossy"}
            )
            assert reply.status_code == 200
            assert len(registry.request_ids) == 3
            assert len(set(registry.request_ids)) == 1
            named = registry.core.named("lossy")
            session = stack.gateway.versioning.get("lossy")
            assert named is not None
            assert session is not None
            assert named.session_key == session.key

            registry.unreachable = True
            with pytest.raises(RequestRefusedError) as err:
                await stack.gateway.sessions.open("unreachable")
            assert err.value.details["stage"] == "open_named"
            refused = await stack.http().post(
                "/generate", json={"text": "x"}, headers={"x-agentic-session": "unreachable-2"}
            )
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "REQUEST_REFUSED"
            assert refused.headers["x-agentic-outcome"] == "refused"
            registry.unreachable = False


# --- settings ---------------------------------------------------------------------------------


async def test_gateway_id_and_session_name_ttl_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with ScriptedFleet() as fleet:
        assert (settings_for(fleet).gateway_id, settings_for(fleet).session_name_ttl) == (
            "gateway",
            3600.0,
        )
        monkeypatch.setenv("AGENTIC_LORA_GATEWAY_ID", "gw-env")
        monkeypatch.setenv("AGENTIC_LORA_SESSION_NAME_TTL", "120")
        assert (settings_for(fleet).gateway_id, settings_for(fleet).session_name_ttl) == (
            "gw-env",
            120.0,
        )
        parser = add_arguments(argparse.ArgumentParser())
        args = parser.parse_args(
            ["--versioned-lora-gateway-id", "gw-flag", "--versioned-lora-session-name-ttl", "7.5"]
        )
        base = settings_for(fleet).model_dump(include={"engines", "base_model_name"})
        flagged = from_args(args, enable_versioned_lora_publication=True, **base)
        assert (flagged.gateway_id, flagged.session_name_ttl) == ("gw-flag", 7.5)
        for values, check in (
            ({"gateway_id": ""}, "gateway_id"),
            ({"gateway_id": "has space"}, "gateway_id"),
            ({"gateway_id": "g" * 201}, "gateway_id"),
            ({"session_name_ttl": 0}, "session_name_ttl"),
            ({"session_name_ttl": float("inf")}, "session_name_ttl"),
        ):
            with pytest.raises(ConfigurationError) as bad:
                load_settings(**{**settings_for(fleet).model_dump(), **values})
            assert bad.value.details["check"] == check

        monkeypatch.delenv("AGENTIC_LORA_GATEWAY_ID")
        stack = await start_gateway(
            fleet, OpenAIRoutes(fleet), tmp_path, gateway_id="gw-a", session_name_ttl=5.0
        )
        try:
            lease = stack.gateway.versioning.lease
            assert lease is not None
            assert (lease.owner, lease.on_restart) == ("gw-a", "adopt")
            assert lease.current.lease_id.startswith("gw-a/")
        finally:
            await stack.gateway.aclose()


async def test_the_gateway_logs_a_session_it_continues(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = str(tmp_path / "registry.sqlite")
    async with fleet_and_routes() as (fleet, routes):
        first = await start_gateway(fleet, routes, tmp_path, journal_path=journal)
        await first.publish("A", 1)
        await chat(first.agent("agent-x"))
        async with restarted(first, journal_path=journal) as second:
            with caplog.at_level(logging.INFO, logger="agentic_lora.gateway.sessions"):
                await chat(second.agent("agent-x"))
            (record,) = [
                r for r in caplog.records if r.getMessage() == "session continued from the registry"
            ]
            assert getattr(record, "version") == "A"  # noqa: B009


# --- GatewaySessions on its own (no engine is called) --------------------------------------------


class ForwardingRegistry(RegistryVerbs):
    """A registry front end with no synchronous reads, like the Ray client: every verb goes to
    a LocalRegistry behind it."""

    def __init__(self, behind: LocalRegistry) -> None:
        self.behind = behind

    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        return await self.behind._call(verb, request_id, args)

    async def status(self) -> RegistryStatus:
        return await self.behind.status()

    async def version(self, version_id: str) -> VersionStatus:
        return await self.behind.version(version_id)

    def peek_version(self, version_id: str) -> VersionStatus | None:
        return self.behind.peek_version(version_id)


@contextlib.asynccontextmanager
async def bare_sessions(
    fleet: ScriptedFleet,
    registry: RegistryAPI,
    *,
    owner: str = "gateway",
    lease: bool = True,
) -> AsyncIterator[tuple[Versioning, GatewaySessions]]:
    versioning = Versioning.from_settings(
        settings_for(fleet, lease_ttl=1e6),
        registry=registry,
        lease_owner=owner,
        lease_on_restart="adopt",
    )
    sessions = GatewaySessions(versioning, lease=versioning.lease if lease else None)
    try:
        yield versioning, sessions
    finally:
        with contextlib.suppress(SessionReleaseError):
            await versioning.aclose()


def local_registry(fleet: ScriptedFleet, **options: Any) -> LocalRegistry:
    return LocalRegistry(engines=[e.name for e in fleet.refs], capacity=2, **options)


async def test_the_gateway_needs_versioned_sessions() -> None:
    with ScriptedFleet() as fleet:
        versioning = Versioning.from_settings(
            settings_for(fleet, enable_versioned_lora_publication=False)
        )
        with pytest.raises(SessionStateError) as err:
            GatewaySessions(versioning)
        assert err.value.details == {"reason": "pass_through"}
        await versioning.aclose()


async def test_over_a_remote_registry_a_session_closed_elsewhere_is_refused_at_its_bind() -> None:
    with ScriptedFleet() as fleet:
        behind = local_registry(fleet)
        registry = ForwardingRegistry(behind)
        async with (
            bare_sessions(fleet, registry, owner="gw-1") as (_, one),
            bare_sessions(fleet, registry, owner="gw-2") as (_, two),
        ):
            mine = await one.open("x")
            theirs = await two.open("x")
            assert mine.key == theirs.key
            await one.close("x")
            # No synchronous read over a remote registry: the cached copy is handed out ...
            assert await two.open("x") is theirs
            # ... and the registry refuses it at the bind, before anything is sent.
            with pytest.raises(SessionClosedError):
                await theirs.generate({"text": "x"})
            assert fleet.calls() == 0
        await behind.aclose()


async def test_without_a_lease_names_are_held_by_no_owner() -> None:
    with ScriptedFleet() as fleet:
        registry = local_registry(fleet)
        async with bare_sessions(fleet, registry, lease=False) as (_, sessions):
            await sessions.start()  # nothing to open
            await sessions.open("x")
            named = registry.core.named("x")
            assert named is not None
            assert named.lease is None
            assert (await registry.status()).leases == ()
        await registry.aclose()


async def test_a_session_the_python_api_opened_is_served_as_it_is() -> None:
    with ScriptedFleet() as fleet:
        registry = local_registry(fleet)
        async with bare_sessions(fleet, registry) as (versioning, sessions):
            own = versioning.open_session("py")
            assert await sessions.open("py") is own
            assert sessions.live() == 1
            assert registry.core.named("py") is None  # not a durable name: opened elsewhere

            # The Python API opens the id while the gateway looks its name up.
            lookup = asyncio.ensure_future(sessions.open("race"))
            await asyncio.sleep(0)  # the lookup is scheduled, not run yet
            versioning.open_session("race")
            with pytest.raises(SessionStateError):
                await lookup
        await registry.aclose()


async def test_a_close_waits_for_an_open_of_the_same_id_in_flight() -> None:
    with ScriptedFleet() as fleet:
        registry = local_registry(fleet)
        async with bare_sessions(fleet, registry) as (_, sessions):
            opening = asyncio.ensure_future(sessions.open("c"))
            await asyncio.sleep(0)  # the lookup is scheduled, not run yet
            result = await sessions.close("c")
            assert result is not None
            assert result.version_id is None
            assert (await opening).phase is SessionPhase.CLOSED
            with pytest.raises(SessionClosedError):
                await sessions.open("c")
        await registry.aclose()


class NoLeaseRegistry(LocalRegistry):
    """A registry that never confirms an ``open_lease`` (its replies are all lost)."""

    async def open_lease(self, **kwargs: Any) -> LeaseGrant:
        raise ConnectionError("registry unreachable (scripted)")


async def test_without_a_confirmed_lease_requests_are_refused_and_start_only_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ScriptedFleet() as fleet:
        registry = NoLeaseRegistry(engines=[e.name for e in fleet.refs], capacity=2)
        async with bare_sessions(fleet, registry) as (_, sessions):
            with caplog.at_level(logging.WARNING, logger="agentic_lora.gateway.sessions"):
                await sessions.start()
            assert [r.getMessage() for r in caplog.records if r.name.endswith("sessions")] == [
                "gateway lease not opened at start; the first request opens it"
            ]
            with pytest.raises(RequestRefusedError) as err:
                await sessions.open("x")
            assert err.value.details["stage"] == "lease"
            assert registry.core.named("x") is None
        await registry.aclose()


async def test_a_local_copy_whose_close_fails_keeps_refusing_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ScriptedFleet() as fleet:
        registry = local_registry(fleet)
        async with (
            bare_sessions(fleet, registry, owner="gw-1") as (_, one),
            bare_sessions(fleet, registry, owner="gw-2") as (versioning, two),
        ):
            await one.open("x")
            await two.open("x")
            await one.close("x")
            await registry.aclose()  # the close of replica 2's copy cannot be confirmed
            with caplog.at_level(logging.WARNING, logger="agentic_lora.gateway.sessions"):
                with pytest.raises(SessionClosedError):
                    await two.open("x")
                await two.retired()
            (record,) = caplog.records
            assert record.getMessage() == "local copy of a Session closed elsewhere not confirmed"
            copy = versioning.get("x")
            assert copy is not None
            assert copy.phase is SessionPhase.FINALIZING
            with pytest.raises(SessionClosedError):
                await two.open("x")
