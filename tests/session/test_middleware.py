"""The dispatch chain pieces: adapter pin, dispatch guard, routing, chain order."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import pytest
from agentic_lora_vllm.dialect import VllmDialect

from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.routing import InFlightCounter
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionStateError
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.errors import VersionUnavailableError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.requests import Route
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id
from agentic_lora.session.middleware import AdapterInFlight
from agentic_lora.session.middleware import AdapterPinMiddleware
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import DispatchGuardMiddleware
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import InFlight
from agentic_lora.session.middleware import Middleware
from agentic_lora.session.middleware import PeekGuard
from agentic_lora.session.middleware import RoutingMiddleware
from agentic_lora.session.middleware import build_chain
from agentic_lora.session.middleware import pin_adapter
from tests.session_support import Calls
from tests.session_support import harness
from tests.session_support import publish

VLLM = VllmDialect()
LORA = "policy_lora@0-v1-0123456789abcdef"
BASE = "base-model"
BINDING = Binding(session_key="s#1", ref=VersionRef("v1", "d", LORA, 1), default_revision=1)


def test_generate_gets_the_bound_lora_path() -> None:
    assert pin_adapter(Route.GENERATE, {"text": "x"}, LORA, BASE) == {
        "text": "x",
        "lora_path": LORA,
    }
    assert (
        pin_adapter(Route.GENERATE, {"text": "x", "lora_path": LORA}, LORA, None)["lora_path"]
        == LORA
    )
    with pytest.raises(AdapterMismatchError) as err:
        pin_adapter(Route.GENERATE, {"text": "x", "lora_path": "policy_lora"}, LORA, BASE)
    assert err.value.details == {"given": "policy_lora", "bound": LORA}


@pytest.mark.parametrize("given", [None, BASE, f"{BASE}:{LORA}", LORA])
def test_openai_model_is_always_the_explicit_base_colon_adapter(given: str | None) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    if given is not None:
        body["model"] = given
    out = pin_adapter(Route.CHAT_COMPLETIONS, body, LORA, BASE)
    assert out["model"] == f"{BASE}:{LORA}"
    assert body.get("model") == given  # the caller's body is not modified


@pytest.mark.parametrize(
    "body",
    [
        {"model": f"{BASE}:other-adapter"},
        {"model": "other-adapter"},
        {"model": f"other-base:{LORA}"},
        {"model": BASE, "lora_path": "other-adapter"},
        {"model": 7},
    ],
)
def test_openai_requests_naming_another_adapter_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(AdapterMismatchError):
        pin_adapter(Route.COMPLETIONS, {"prompt": "x", **body}, LORA, BASE)


def test_openai_routes_need_a_base_model_name() -> None:
    with pytest.raises(ConfigurationError) as err:
        pin_adapter(Route.COMPLETIONS, {"prompt": "x"}, LORA, None)
    assert err.value.details["check"] == "base_model_name"


@pytest.mark.parametrize("given", [None, BASE, f"{BASE}:{LORA}", LORA])
@pytest.mark.parametrize("route", [Route.CHAT_COMPLETIONS, Route.COMPLETIONS])
def test_vllm_openai_routes_name_the_adapter_itself_as_the_model(
    route: Route, given: str | None
) -> None:
    body: dict[str, Any] = {"prompt": "x", "lora_path": LORA}
    if given is not None:
        body["model"] = given
    out = pin_adapter(route, body, LORA, BASE, dialect=VLLM)
    assert out["model"] == LORA
    assert "lora_path" not in out  # vLLM ignores it: never sent, so it cannot mislead a reader
    assert body.get("model") == given  # the caller's body is not modified
    assert body["lora_path"] == LORA


@pytest.mark.parametrize(
    "body",
    [
        {"model": "other-adapter"},
        {"model": f"{BASE}:other-adapter"},
        {"model": f"other-base:{LORA}"},
        {"model": LORA, "lora_path": "other-adapter"},
        {"model": 7},
    ],
)
def test_vllm_requests_naming_another_adapter_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(AdapterMismatchError):
        pin_adapter(Route.COMPLETIONS, {"prompt": "x", **body}, LORA, BASE, dialect=VLLM)


def test_vllm_pins_without_a_base_model_but_then_cannot_recognise_it() -> None:
    assert pin_adapter(Route.COMPLETIONS, {"prompt": "x"}, LORA, None, dialect=VLLM) == {
        "prompt": "x",
        "model": LORA,
    }
    with pytest.raises(AdapterMismatchError):
        pin_adapter(Route.COMPLETIONS, {"prompt": "x", "model": BASE}, LORA, None, dialect=VLLM)


def test_vllm_has_no_generate_route() -> None:
    # The route is checked by the Session before it binds (once), not by the pin.
    with pytest.raises(InvalidRequestError) as err:
        VLLM.check_route(Route.GENERATE)
    assert err.value.details["reason"] == "route_unsupported"
    assert err.value.details["engine_kind"] == "vllm"


@pytest.mark.asyncio
async def test_the_pin_middleware_addresses_the_adapter_per_dialect() -> None:
    sglang = build_chain(endpoint, [Middleware(AdapterPinMiddleware, base_model=BASE)])
    vllm = build_chain(endpoint, [Middleware(AdapterPinMiddleware, base_model=BASE, dialect=VLLM)])
    call = EngineCall(Route.COMPLETIONS, {"prompt": "x", "model": BASE}, "s#1", BINDING)
    assert (await sglang(call)).body["model"] == f"{BASE}:{LORA}"
    assert (await vllm(call)).body["model"] == LORA


@pytest.mark.asyncio
async def test_adapter_in_flight_counts_per_name_and_wakes_waiters_when_one_drains() -> None:
    counter = AdapterInFlight()
    await counter.wait_drained("a")  # nothing in flight: returns at once
    log: list[str] = []
    ends = {"a1": asyncio.Event(), "a2": asyncio.Event(), "b": asyncio.Event()}
    started = {name: asyncio.Event() for name in ends}

    async def request(key: str, lora_name: str) -> None:
        with counter.track(lora_name):
            started[key].set()
            await ends[key].wait()
            log.append(f"{key} ended")

    async def drain(lora_name: str) -> None:
        await counter.wait_drained(lora_name)
        log.append(f"{lora_name} drained")

    tasks = [
        asyncio.create_task(request("a1", "a")),
        asyncio.create_task(request("a2", "a")),
        asyncio.create_task(request("b", "b")),
    ]
    await asyncio.gather(*(e.wait() for e in started.values()))
    assert (counter.count("a"), counter.count("b"), counter.busy()) == (2, 1, {"a": 2, "b": 1})
    waiters = [asyncio.create_task(drain("a")), asyncio.create_task(drain("b"))]
    # Every event is set before the loop runs anything: the log shows who waited for whom.
    ends["a1"].set()
    ends["b"].set()
    await tasks[0]
    await tasks[2]
    await waiters[1]
    assert not waiters[0].done()  # a2 still runs on "a"
    ends["a2"].set()
    await asyncio.gather(*tasks, *waiters)
    assert log == ["a1 ended", "b ended", "b drained", "a2 ended", "a drained"]
    assert counter.busy() == {}


@pytest.mark.asyncio
async def test_adapter_in_flight_wakes_the_waiters_of_a_busy_period_at_its_end_only() -> None:
    counter = AdapterInFlight()
    first_period, second_period = Calls(count=2), Calls(count=3)
    counter.on_wait.extend([first_period, second_period])
    counter.enter("a")
    early = [asyncio.create_task(counter.wait_drained("a")) for _ in range(2)]
    await first_period.wait()
    counter.leave("a")  # the period both waited for ends ...
    counter.enter("a")  # ... and the next one starts before either of them runs again
    late = asyncio.create_task(counter.wait_drained("a"))
    await second_period.wait()
    await asyncio.gather(*early)  # woken by the end of their own period
    assert not late.done()  # the next period has not ended
    counter.leave("a")
    await late
    assert counter.busy() == {}


@pytest.mark.asyncio
async def test_adapter_in_flight_tells_its_listeners_when_a_drain_starts_to_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter = AdapterInFlight()
    told = Calls()

    def broken(lora_name: str, in_flight: int) -> None:
        raise RuntimeError("listener bug")

    counter.on_wait.extend([broken, told])
    await counter.wait_drained("a")  # nothing in flight: returns at once, nobody is told
    assert told.calls == []
    with counter.track("a"), counter.track("a"):
        waiter = asyncio.create_task(counter.wait_drained("a"))
        await told.wait()
        assert not waiter.done()
    await waiter
    # The broken listener was logged and skipped; the next one was still told.
    assert told.calls == [("a", 2)]
    [failure] = [r for r in caplog.records if r.exc_info is not None]
    assert (failure.version, failure.in_flight) == ("a", 2)  # type: ignore[attr-defined]


class Recorder:
    """A framework middleware that records what it saw, then passes on."""

    def __init__(self, next_dispatch: Dispatch, *, name: str, log: list[str]) -> None:
        self._next, self._name, self._log = next_dispatch, name, log

    async def __call__(self, call: EngineCall) -> EngineReply:
        self._log.append(f"{self._name}:{call.body.get('lora_path')}")
        return await self._next(call)


async def endpoint(call: EngineCall) -> EngineReply:
    return EngineReply(
        engine=call.engine or "-", path=call.route.value, status_code=200, body=dict(call.body)
    )


@pytest.mark.asyncio
async def test_chain_runs_in_listed_order_and_the_pin_checks_what_framework_middleware_set() -> (
    None
):
    log: list[str] = []
    chain = build_chain(
        endpoint,
        [
            Middleware(Recorder, name="outer", log=log),
            Middleware(AdapterPinMiddleware, base_model=BASE),
            Middleware(Recorder, name="inner", log=log),
        ],
    )
    reply = await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING))
    assert log == ["outer:None", f"inner:{LORA}"]
    assert reply.body["lora_path"] == LORA
    assert "AdapterPinMiddleware" in repr(Middleware(AdapterPinMiddleware, base_model=BASE))


@pytest.mark.asyncio
async def test_a_versioned_dispatch_without_binding_fails_closed() -> None:
    chain = build_chain(endpoint, [Middleware(AdapterPinMiddleware, base_model=BASE)])
    with pytest.raises(SessionStateError):
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", None))


def status(state: VersionState, lora: str = LORA) -> VersionStatus:
    return VersionStatus(
        version_id="v1", digest="d", lora_name=lora, state=state, attempt=1, session_refs=0
    )


@pytest.mark.parametrize("state", list(VersionState))
def test_peek_guard_allows_only_published_and_retired(state: VersionState) -> None:
    guard = PeekGuard(lambda _vid: status(state))
    if state in (VersionState.PUBLISHED, VersionState.RETIRED):
        guard.check(BINDING)
    else:
        with pytest.raises(VersionNotDispatchableError) as err:
            guard.check(BINDING)
        assert err.value.details["state"] == state.value


def test_peek_guard_refuses_unknown_and_renamed_versions() -> None:
    with pytest.raises(VersionNotDispatchableError, match="unknown"):
        PeekGuard(lambda _vid: None).check(BINDING)
    with pytest.raises(VersionNotDispatchableError, match="not the bound"):
        PeekGuard(lambda _vid: status(VersionState.PUBLISHED, "other")).check(BINDING)


@pytest.mark.asyncio
async def test_guard_over_the_real_registry_refuses_reclaimed_versions_before_the_endpoint() -> (
    None
):
    registry = LocalRegistry(engines=("e0", "e1"), capacity=2)
    reached: list[EngineCall] = []

    async def record(call: EngineCall) -> EngineReply:
        reached.append(call)
        return await endpoint(call)

    chain = build_chain(
        record, [Middleware(DispatchGuardMiddleware, guard=PeekGuard(registry.peek_version))]
    )
    a = await publish(registry, "A")
    bound = Binding("s#1", a.ref, 1)
    await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", bound))
    await publish(registry, "B")
    claim = await registry.claim_reclaim(request_id=new_request_id(), version_id="A")
    for engine in ("e0", "e1"):
        with pytest.raises(VersionNotDispatchableError):
            await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", bound))
        await registry.confirm_reclaim(
            request_id=new_request_id(), version_id="A", reclaim_id=claim.reclaim_id, engine=engine
        )
    assert registry.peek_version("A").state is VersionState.RECLAIMED  # type: ignore[union-attr]
    with pytest.raises(VersionNotDispatchableError, match="RECLAIMED"):
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", bound))
    assert len(reached) == 1
    await registry.aclose()


class ScriptedRouter(InFlightCounter):
    def __init__(self, pick: str, *, tamper: bool = False) -> None:
        super().__init__()
        self.pick, self.tamper = pick, tamper
        self.offered: list[tuple[str, ...]] = []

    def choose(
        self, session_key: str | None, engines: Sequence[str], request: Mapping[str, Any]
    ) -> str:
        self.offered.append(tuple(engines))
        if self.tamper:
            request["lora_path"] = "evil"  # type: ignore[index]
        return self.pick


@pytest.mark.asyncio
async def test_routing_offers_healthy_engines_and_balances_in_flight_counts() -> None:
    health = EngineHealth(["e0", "e1"])
    router = ScriptedRouter("e1")

    async def failing(call: EngineCall) -> EngineReply:
        assert router.in_flight("e1") == 1
        raise RequestRefusedError("scripted")

    ticket = InFlight(rid="r1")
    chain = build_chain(endpoint, [Middleware(RoutingMiddleware, router=router, health=health)])
    reply = await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", ticket=ticket))
    assert (reply.engine, ticket.engine, router.in_flight("e1")) == ("e1", "e1", 0)

    failing_chain = build_chain(
        failing, [Middleware(RoutingMiddleware, router=router, health=health)]
    )
    with pytest.raises(RequestRefusedError):
        await failing_chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1"))
    assert router.in_flight("e1") == 0

    health.mark_unhealthy("e0")
    await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1"))
    assert router.offered[-1] == ("e1",)
    health.mark_unhealthy("e1")
    with pytest.raises(RequestRefusedError, match="no healthy engine"):
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1"))
    with pytest.raises(ConfigurationError):
        health.mark_unhealthy("e7")


@pytest.mark.asyncio
async def test_a_router_cannot_change_the_body_or_pick_outside_the_fleet() -> None:
    health = EngineHealth(["e0", "e1"])
    tamper = build_chain(
        endpoint,
        [Middleware(RoutingMiddleware, router=ScriptedRouter("e0", tamper=True), health=health)],
    )
    with pytest.raises(TypeError):
        await tamper(EngineCall(Route.GENERATE, {"text": "x", "lora_path": LORA}, "s#1"))
    rogue = build_chain(
        endpoint, [Middleware(RoutingMiddleware, router=ScriptedRouter("e9"), health=health)]
    )
    with pytest.raises(ConfigurationError) as err:
        await rogue(EngineCall(Route.GENERATE, {"text": "x"}, "s#1"))
    assert err.value.details["check"] == "router"


@pytest.mark.asyncio
async def test_versioning_without_a_peekable_registry_needs_an_explicit_guard() -> None:
    async with harness() as h:

        class NoPeek:
            pass

        from agentic_lora.session import Versioning

        with pytest.raises(ConfigurationError) as err:
            Versioning(transport=h.transport, registry=NoPeek(), base_model=BASE)  # type: ignore[arg-type]
        assert err.value.details["check"] == "dispatch_guard"
        with pytest.raises(ConfigurationError) as missing:
            Versioning(transport=h.transport, registry=None, enabled=True)
        assert missing.value.details["check"] == "registry"


# --- routing to the engines that hold the version ------------------------------------------------


def held_by(*engines: str, state: VersionState = VersionState.PUBLISHED) -> VersionStatus:
    return VersionStatus(
        version_id="v1",
        digest="d",
        lora_name=LORA,
        state=state,
        attempt=1,
        session_refs=1,
        ready_engines=engines,
    )


def test_peek_guard_names_the_engines_that_hold_the_version() -> None:
    assert PeekGuard(lambda _vid: held_by("e1")).check(BINDING) == ("e1",)
    assert PeekGuard(lambda _vid: held_by(state=VersionState.RETIRED)).check(BINDING) == ()


def test_engine_call_copies_keep_every_other_field() -> None:
    ticket = InFlight(rid="r")
    call = EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING, None, ticket, ("e0",))
    assert call.with_body({"text": "y"}) == EngineCall(
        Route.GENERATE, {"text": "y"}, "s#1", BINDING, None, ticket, ("e0",)
    )
    assert call.with_engines(None).engines is None
    routed = call.routed_to("e0")
    assert (routed.engine, routed.engines, routed.ticket, routed.body) == (
        "e0",
        ("e0",),
        ticket,
        call.body,
    )


def holder_chain(
    holders: tuple[str, ...] | None,
    router: ScriptedRouter,
    health: EngineHealth,
    endpoint_: Dispatch = endpoint,
    on_refused: Sequence[Any] = (),
) -> Dispatch:
    class Guard:
        def check(self, binding: Binding) -> tuple[str, ...] | None:
            return holders

    return build_chain(
        endpoint_,
        [
            Middleware(DispatchGuardMiddleware, guard=Guard()),
            Middleware(RoutingMiddleware, router=router, health=health, on_refused=on_refused),
        ],
    )


@pytest.mark.asyncio
async def test_routing_offers_only_healthy_engines_that_hold_the_version() -> None:
    health = EngineHealth(["e0", "e1", "e2"])
    router = ScriptedRouter("e1")
    call = EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING)
    await holder_chain(("e1", "e2"), router, health)(call)
    await holder_chain(("e0", "e1", "e2"), router, health)(call)
    await holder_chain(None, router, health)(call)  # a guard that does not restrict
    health.mark_unhealthy("e2")
    await holder_chain(("e1", "e2"), router, health)(call)
    await holder_chain(("e0", "e1", "e2"), router, health)(call)
    assert router.offered == [
        ("e1", "e2"),
        ("e0", "e1", "e2"),
        ("e0", "e1", "e2"),
        ("e1",),
        ("e0", "e1"),
    ]


@pytest.mark.asyncio
async def test_no_healthy_holder_is_version_unavailable_and_nothing_is_sent() -> None:
    health = EngineHealth(["e0", "e1"])
    router = ScriptedRouter("e0")
    reached: list[EngineCall] = []

    async def record(call: EngineCall) -> EngineReply:
        reached.append(call)
        return await endpoint(call)

    heard: list[tuple[str, Binding]] = []
    chain = holder_chain((), router, health, record, [lambda e, b: heard.append((e, b))])
    with pytest.raises(VersionUnavailableError) as err:
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING))
    assert err.value.code == "VERSION_UNAVAILABLE"
    assert isinstance(err.value, RequestRefusedError)
    assert err.value.details == {
        "version": "v1",
        "lora_name": LORA,
        "lacking": ["e0", "e1"],
        "holders": [],
        "session": "s#1",
    }
    health.mark_unhealthy("e1")
    with pytest.raises(VersionUnavailableError) as unhealthy_holder:
        await holder_chain(("e1",), router, health, record)(
            EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING)
        )
    assert (
        unhealthy_holder.value.details["lacking"],
        unhealthy_holder.value.details["holders"],
    ) == (
        ["e0"],
        ["e1"],
    )
    # Without a binding (a custom chain) the error still says what it can.
    with pytest.raises(VersionUnavailableError) as unbound:
        await build_chain(record, [Middleware(RoutingMiddleware, router=router, health=health)])(
            EngineCall(Route.GENERATE, {"text": "x"}, None, None, engines=("e1",))
        )
    assert unbound.value.details["version"] is None
    assert reached == []
    assert router.offered == []
    assert heard == []


@pytest.mark.asyncio
async def test_an_engine_refusing_a_versioned_request_is_reported_to_listeners(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = EngineHealth(["e0", "e1"])
    router = ScriptedRouter("e1")
    outcomes: list[Exception] = [
        RequestRefusedError("HTTP 400", status=400),
        RequestIndeterminateError("HTTP 500", status=500),
        RequestRefusedError("HTTP 400", status=400),
    ]

    async def failing(call: EngineCall) -> EngineReply:
        raise outcomes.pop(0)

    heard: list[tuple[str, str]] = []
    listeners: list[Any] = []
    chain = holder_chain(("e0", "e1"), router, health, failing, listeners)

    def broken(engine: str, binding: Binding) -> None:
        raise RuntimeError("listener bug")

    # Listeners added after the chain was built are seen (Versioning.on_refused is such a list).
    listeners.extend([broken, lambda e, b: heard.append((e, b.version_id))])
    with pytest.raises(RequestRefusedError, match="HTTP 400"):
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING))
    assert heard == [("e1", "v1")]
    [failure] = [r for r in caplog.records if r.exc_info is not None]
    assert (failure.engine, failure.version) == ("e1", "v1")  # type: ignore[attr-defined]
    with pytest.raises(RequestIndeterminateError):  # may have run: not a refusal
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", BINDING))
    unversioned = build_chain(
        failing,
        [Middleware(RoutingMiddleware, router=router, health=health, on_refused=listeners)],
    )
    with pytest.raises(RequestRefusedError):
        await unversioned(EngineCall(Route.GENERATE, {"text": "x"}, "s#1"))
    assert heard == [("e1", "v1")]
    assert router.in_flight("e1") == 0


@pytest.mark.asyncio
async def test_the_real_registry_routes_a_version_only_to_engines_that_hold_it() -> None:
    registry = LocalRegistry(engines=("e0", "e1"), capacity=2, sweep_interval=None)
    try:
        a = await publish(registry, "A")
        bound = Binding("s#1", a.ref, 1)
        router = ScriptedRouter("e0")
        chain = build_chain(
            endpoint,
            [
                Middleware(DispatchGuardMiddleware, guard=PeekGuard(registry.peek_version)),
                Middleware(RoutingMiddleware, router=router, health=EngineHealth(["e0", "e1"])),
            ],
        )
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", bound))
        # e1 restarted: it holds nothing until the version is loaded and recorded again.
        await registry.observe_incarnation(
            request_id=new_request_id(), engine="e1", incarnation="e1-inc-2"
        )
        await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", bound))
        await registry.observe_incarnation(
            request_id=new_request_id(), engine="e0", incarnation="e0-inc-2"
        )
        with pytest.raises(VersionUnavailableError):
            await chain(EngineCall(Route.GENERATE, {"text": "x"}, "s#1", bound))
        assert router.offered == [("e0", "e1"), ("e0",)]
    finally:
        await registry.aclose()


class Keeper:
    """A framework middleware that keeps every call it was given, to read it after the send."""

    def __init__(self, next_dispatch: Dispatch, *, kept: list[EngineCall]) -> None:
        self._next = next_dispatch
        self._kept = kept

    async def __call__(self, call: EngineCall) -> EngineReply:
        self._kept.append(call)
        return await self._next(call)


@pytest.mark.asyncio
async def test_no_step_of_the_chain_changes_a_call_in_place() -> None:
    kept: list[EngineCall] = []
    async with harness(published="A", middleware=[Middleware(Keeper, kept=kept)]) as h:
        s = h.versioning.open_session("s")
        reply = await s.generate({"text": "x"})
        (call,) = kept
        # The pin, the guard and the router each handed on a changed copy; this one is as the
        # Session made it.
        assert reply.engine in {e.name for e in h.transport.engines}
        assert call.engine is None
        assert call.engines is None
        assert "lora_path" not in call.body
        assert call.binding is not None
        assert call.binding == s.binding
        assert call.ticket is not None
        assert call.ticket.engine == reply.engine
