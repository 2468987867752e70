"""Router plugins: discovery, session affinity, least in flight, and lora_path untouched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from agentic_lora_routers import LeastInFlightRouter
from agentic_lora_routers import SessionAffinityRouter
from agentic_lora_routers.affinity import rendezvous_score
from hypothesis import given
from hypothesis import strategies as st

from agentic_lora.engines.backends import load_backend
from agentic_lora.engines.dialect import load_dialect
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.routing import Router
from agentic_lora.engines.routing import available_routers
from agentic_lora.engines.routing import load_router
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.discovery import BACKENDS_GROUP
from agentic_lora.foundation.discovery import ROUTERS_GROUP
from agentic_lora.foundation.discovery import load_plugin
from agentic_lora.foundation.discovery import plugin_names
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.requests import Route
from agentic_lora.registry.types import Binding
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import Middleware
from agentic_lora.session.middleware import RoutingMiddleware
from agentic_lora.session.middleware import build_chain
from tests.session_support import harness
from tests.session_support import publish

FLEET = ("e0", "e1", "e2", "e3")


def test_builtin_routers_are_found_by_entry_point() -> None:
    assert {"session-affinity", "least-in-flight"} <= set(available_routers())
    assert isinstance(load_router("session-affinity"), SessionAffinityRouter)
    assert isinstance(load_router("least-in-flight"), LeastInFlightRouter)
    assert plugin_names(ROUTERS_GROUP) == available_routers()


@pytest.mark.parametrize(
    ("load", "check", "shipped"),
    [
        (load_router, "router", "session-affinity"),
        (load_backend, "backend", "http-push"),
        (load_dialect, "engine_kind", "sglang"),
    ],
)
def test_an_unknown_plugin_is_a_configuration_error_listing_the_installed_ones(
    load: Callable[[str], object], check: str, shipped: str
) -> None:
    with pytest.raises(ConfigurationError) as unknown:
        load("carrier-pigeon")
    assert (unknown.value.details["check"], unknown.value.details["name"]) == (
        check,
        "carrier-pigeon",
    )
    assert shipped in str(unknown.value)


def test_broken_router_plugins_are_configuration_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigurationError) as bad_options:
        load_router("least-in-flight", weights=[1, 2])
    assert bad_options.value.details["check"] == "router"
    assert plugin_names(BACKENDS_GROUP)  # the built-in backends are declared

    class NotARouter:
        pass

    monkeypatch.setattr(
        "agentic_lora.foundation.discovery.load_plugin", lambda group, name: NotARouter
    )
    with pytest.raises(ConfigurationError, match="Router protocol"):
        load_router("anything")


def test_a_plugin_that_fails_to_import_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    class BrokenEntryPoint:
        name = "broken"
        value = "nowhere:Nothing"

        def load(self) -> Any:
            raise ImportError("No module named 'nowhere'")

    monkeypatch.setattr(
        "agentic_lora.foundation.discovery.entry_points", lambda group: [BrokenEntryPoint()]
    )
    with pytest.raises(ConfigurationError, match="failed to load") as err:
        load_plugin(ROUTERS_GROUP, "broken")
    assert err.value.details["name"] == "broken"


def test_routers_satisfy_the_protocol() -> None:
    assert isinstance(SessionAffinityRouter(), Router)
    assert isinstance(LeastInFlightRouter(), Router)


@given(
    keys=st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=40, unique=True),
    down=st.sets(st.sampled_from(FLEET), max_size=len(FLEET) - 1),
)
def test_affinity_moves_only_sessions_whose_engine_went_down(
    keys: list[str], down: set[str]
) -> None:
    router = SessionAffinityRouter()
    healthy = tuple(e for e in FLEET if e not in down)
    for key in keys:
        home = router.choose(key, FLEET, {})
        assert router.choose(key, FLEET, {}) == home  # stable while nothing changes
        during = router.choose(key, healthy, {})
        if home in healthy:
            assert during == home  # its engine is healthy: it stays
        else:
            assert during in healthy
        assert router.choose(key, FLEET, {}) == home  # back when the engine returns


def test_affinity_answers_by_its_definition_on_every_call_and_every_offer() -> None:
    # Its answers are remembered per (Session, offered engines): a remembered one must be the
    # one the weights give for exactly that offer.
    router = SessionAffinityRouter()
    for i in range(300):
        key = f"session-{i}"
        for offer in (FLEET, FLEET[1:], list(FLEET[:2]), FLEET):
            heaviest = max(offer, key=lambda e, k=key: (rendezvous_score(k, e), e))
            assert router.choose(key, offer, {}) == heaviest
            assert router.choose(key, offer, {}) == heaviest


def test_affinity_spreads_sessions_over_the_fleet() -> None:
    router = SessionAffinityRouter()
    homes = [router.choose(f"session-{i}", FLEET, {}) for i in range(2000)]
    assert all(homes.count(e) > 2000 / len(FLEET) * 0.8 for e in FLEET)


def test_affinity_without_a_session_and_least_in_flight_pick_the_least_busy() -> None:
    for router in (SessionAffinityRouter(), LeastInFlightRouter()):
        router.on_dispatch("e0", None)
        router.on_dispatch("e0", None)
        router.on_dispatch("e1", None)
        assert router.choose(None, ("e0", "e1", "e2"), {}) == "e2"
        router.on_dispatch("e2", None)
        router.on_dispatch("e2", None)
        assert router.choose(None, ("e0", "e1", "e2"), {}) == "e1"
        router.on_complete("e0", None)
        router.on_complete("e0", None)
        assert router.choose(None, ("e0", "e1", "e2"), {}) == "e0"
        with pytest.raises(RuntimeError):
            router.on_complete("e3", None)


def test_least_in_flight_breaks_ties_in_turn() -> None:
    router = LeastInFlightRouter()
    picks = [router.choose("s", ("e0", "e1", "e2"), {}) for _ in range(6)]
    assert picks == ["e0", "e1", "e2", "e0", "e1", "e2"]
    with pytest.raises(ValueError, match="no engine"):
        router.choose("s", (), {})


@pytest.mark.asyncio
@pytest.mark.parametrize("router_name", ["session-affinity", "least-in-flight"])
async def test_routers_never_change_lora_path_and_affinity_keeps_a_session_on_one_engine(
    router_name: str,
) -> None:
    async with harness(router=load_router(router_name)) as h:
        a = await publish(h.registry, "A")
        s1 = h.versioning.open_session("S1")
        s2 = h.versioning.open_session("S2")
        for i in range(10):
            await asyncio.gather(s1.generate({"text": f"S1 {i}"}), s2.generate({"text": f"S2 {i}"}))
        sent = h.engines.generations()
        assert {g.body["lora_path"] for g in sent} == {a.lora_name}
        engines_of = {
            tag: {g.engine for g in sent if str(g.body["text"]).startswith(tag + " ")}
            for tag in ("S1", "S2")
        }
        if router_name == "session-affinity":
            assert all(len(e) == 1 for e in engines_of.values())
            # Marking the Session's engine unhealthy moves it; marking it healthy brings it back.
            (home,) = engines_of["S1"]
            h.versioning.health.mark_unhealthy(home)
            await s1.generate({"text": "S1 moved"})
            h.versioning.health.mark_healthy(home)
            await s1.generate({"text": "S1 back"})
            moved, back = h.engines.generations()[-2:]
            assert (moved.engine != home, back.engine) == (True, home)
        else:
            assert set().union(*engines_of.values()) == {"e0", "e1"}


@pytest.mark.asyncio
async def test_affinity_moves_a_session_off_an_engine_that_lost_its_version_and_back() -> None:
    """Through the dispatch chain: an engine that restarted drops out of the version's holders;
    only the Sessions that lived there move (to another holder), and they return once the
    version is loaded there again. Every other Session stays where its prefix cache is."""
    router = SessionAffinityRouter()
    health = EngineHealth(FLEET)
    seen: list[str] = []

    async def endpoint(call: EngineCall) -> EngineReply:
        assert call.engine is not None
        seen.append(call.engine)
        return EngineReply(engine=call.engine, path=call.route.value, status_code=200, body={})

    chain = build_chain(endpoint, [Middleware(RoutingMiddleware, router=router, health=health)])

    async def engine_of(key: str, holders: tuple[str, ...]) -> str:
        binding = Binding(key, VersionRef("A", "d", "lora-A", 1), 1)
        call = EngineCall(Route.GENERATE, {"text": "x"}, key, binding, engines=holders)
        return (await chain(call)).engine

    for i in range(64):
        key = f"session-{i}"
        home = await engine_of(key, FLEET)
        lost = tuple(e for e in FLEET if e != "e2")
        during = await engine_of(key, lost)
        assert during == home if home != "e2" else during in lost
        assert await engine_of(key, FLEET) == home
    assert "e2" in seen  # some Sessions did live on the engine that lost the version
