"""Prometheus metrics: scraped from a running gateway while a publication, generations, a close
and a reclaim happen (scripted engines at the HTTP edge), plus the observers on their own."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentic_lora.assembly.metrics import Metrics
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import RequestTooLargeError
from agentic_lora.errors import VersionConflictError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.requests import Route
from agentic_lora.gateway.progress import ProgressHub
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PhaseStatus
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import InFlight
from agentic_lora.session.middleware import build_chain
from tests.gateway.test_gateway import Stack
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import gateway_stack

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(stack: Stack) -> Samples:
    response = await stack.http().get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


CHAT = "/v1/chat/completions"


@pytest.mark.asyncio
async def test_a_scrape_during_a_run_shows_the_counters_moving(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        m = await scrape(stack)
        assert value(m, "agentic_lora_capacity_slots") == 2
        assert value(m, "agentic_lora_capacity_slots_in_use") == 0
        assert value(m, "agentic_lora_dispatches_total", route=CHAT, outcome="ok") == 0
        assert value(m, "agentic_lora_publications_total", outcome="published") == 0

        await stack.publish("A", 1)
        m = await scrape(stack)
        assert value(m, "agentic_lora_publications_total", outcome="published") == 1
        assert (
            value(m, "agentic_lora_publication_phase_seconds_count", phase="prepare", result="ok")
            == 2  # one per engine
        )
        assert (
            value(m, "agentic_lora_publication_phase_seconds_count", phase="commit", result="ok")
            == 1
        )
        assert value(m, "agentic_lora_capacity_slots_in_use") == 1
        assert value(m, "agentic_lora_versions", state="published") == 1
        assert value(m, "agentic_lora_default_revision") == 1

        agent = stack.agent("episode-1")
        await chat(agent)
        m = await scrape(stack)
        assert value(m, "agentic_lora_dispatches_total", route=CHAT, outcome="ok") == 1
        assert value(m, "agentic_lora_sessions_live") == 1
        assert value(m, "agentic_lora_registry_sessions") == 1
        assert value(m, "agentic_lora_bound_sessions", version_state="published") == 1
        assert value(m, "agentic_lora_registry_changes_total", verb="bind_first") == 1

        stack.routes.fail_next("unreachable")
        with pytest.raises(openai.APIStatusError):
            await chat(stack.agent("episode-2"))
        stack.routes.faults = {name: deque() for name in stack.routes.faults}
        stack.routes.fail_next("lose_reply")
        with pytest.raises(openai.InternalServerError):
            await chat(agent)
        stack.routes.faults = {name: deque() for name in stack.routes.faults}
        m = await scrape(stack)
        assert value(m, "agentic_lora_dispatches_total", route=CHAT, outcome="refused") == 1
        assert value(m, "agentic_lora_dispatches_total", route=CHAT, outcome="indeterminate") == 1

        await stack.publish("B", 2)
        with pytest.raises(VersionConflictError):
            await stack.publish("B", 3)
        m = await scrape(stack)
        assert value(m, "agentic_lora_publications_total", outcome="published") == 2
        assert value(m, "agentic_lora_publications_total", outcome="error") == 1
        assert value(m, "agentic_lora_publication_errors_total", code="VERSION_CONFLICT") == 1
        # episode-2 bound to A before its engine refused the request: two refs on A.
        assert value(m, "agentic_lora_bound_sessions", version_state="retired") == 2
        assert value(m, "agentic_lora_capacity_slots_in_use") == 2

        for session_id in ("episode-1", "episode-2"):
            await stack.http().post(
                f"/v1/sessions/{session_id}/close", headers={"x-agentic-session": session_id}
            )
        await stack.gateway.deployment.reclaimer.settled()
        m = await scrape(stack)
        assert value(m, "agentic_lora_reclaim_wait_seconds_count", result="ok") == 2
        assert value(m, "agentic_lora_versions_reclaimed_total") == 1
        assert value(m, "agentic_lora_versions", state="reclaimed") == 1
        assert value(m, "agentic_lora_capacity_slots_in_use") == 1
        assert value(m, "agentic_lora_sessions_live") == 0
        assert value(m, "agentic_lora_registry_changes_total", verb="release") == 2


@pytest.mark.asyncio
async def test_no_label_names_a_session_or_a_version(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        await stack.publish("version-A", 1)
        await chat(stack.agent("session-xyz"))
        samples = await scrape(stack)
        registry: Any = stack.gateway.deployment.registry
        lora_name = registry.peek_version("version-A").lora_name
    allowed = {
        "outcome",
        "code",
        "phase",
        "result",
        "verb",
        "route",
        "version_state",
        "state",
        "le",
        "engine",  # the configured fleet's names: bounded by the operator, never a version
        "member_state",
    }
    assert samples
    for name, labels in samples:
        assert name.startswith("agentic_lora_"), name
        for key, label_value in labels:
            assert key in allowed, (name, key)
            for secret in ("session-xyz", "version-A", lora_name):
                assert secret not in label_value, (name, key, label_value)


@pytest.mark.asyncio
async def test_the_lag_at_dispatch_and_too_stale_refusals_are_scraped(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, settings={"max_version_lag": 0}) as stack:
        m = await scrape(stack)
        assert value(m, "agentic_lora_session_version_lag_count") == 0
        assert value(m, "agentic_lora_version_too_stale_refusals_total") == 0
        await stack.publish("A", 1)
        old = stack.agent("episode-old")
        await chat(old)  # lag 0
        await stack.publish("B", 2)
        with pytest.raises(openai.ConflictError):
            await chat(old)  # lag 1: refused, VERSION_TOO_STALE
        with pytest.raises(openai.ConflictError):
            await chat(old)  # sticky: refused again at lag 1
        await chat(stack.agent("episode-new"))  # binds B: lag 0
        m = await scrape(stack)
    assert value(m, "agentic_lora_session_version_lag_count") == 4
    assert value(m, "agentic_lora_session_version_lag_sum") == 2
    assert value(m, "agentic_lora_session_version_lag_bucket", le="0.0") == 2
    assert value(m, "agentic_lora_session_version_lag_bucket", le="1.0") == 4
    assert value(m, "agentic_lora_version_too_stale_refusals_total") == 2
    # Refused before the chain: never counted as a dispatch that may have reached an engine.
    assert value(m, "agentic_lora_dispatches_total", route=CHAT, outcome="ok") == 2
    assert value(m, "agentic_lora_dispatches_total", route=CHAT, outcome="refused") == 0


# --- the observers on their own -----------------------------------------------------------------


def test_the_staleness_observers_on_their_own() -> None:
    metrics = Metrics()
    for lag in (0, 3, 5, 40):
        metrics.observe_version_lag(lag)
    metrics.observe_version_too_stale(40)
    m = parse(metrics.exposition().decode())
    assert value(m, "agentic_lora_session_version_lag_bucket", le="4.0") == 2
    assert value(m, "agentic_lora_session_version_lag_bucket", le="6.0") == 3
    assert value(m, "agentic_lora_session_version_lag_bucket", le="32.0") == 3
    assert value(m, "agentic_lora_session_version_lag_bucket", le="+Inf") == 4
    assert value(m, "agentic_lora_version_too_stale_refusals_total") == 1


def _reply(call: EngineCall) -> EngineReply:
    return EngineReply(engine="e0", path=call.route.value, status_code=200, body={})


@pytest.mark.asyncio
async def test_the_dispatch_middleware_counts_each_outcome_once() -> None:
    metrics = Metrics()
    script: deque[BaseException | None] = deque(
        [
            None,
            RequestRefusedError("engine said no", status=400),
            AdapterMismatchError("other adapter"),
            RequestIndeterminateError("reply lost"),
            RuntimeError("a bug after the engine was chosen"),
        ]
    )

    async def endpoint(call: EngineCall) -> EngineReply:
        if call.ticket is not None:
            call.ticket.engine = "e0"  # what RoutingMiddleware does before sending
        failure = script.popleft()
        if failure is not None:
            raise failure
        return _reply(call)

    chain = build_chain(endpoint, [metrics.dispatch_middleware()])
    for _ in range(5):
        call = EngineCall(route=Route.GENERATE, body={}, ticket=InFlight(rid=None))
        with contextlib.suppress(Exception):
            await chain(call)
    counts = parse(metrics.exposition().decode())
    route = Route.GENERATE.value
    assert value(counts, "agentic_lora_dispatches_total", route=route, outcome="ok") == 1
    assert value(counts, "agentic_lora_dispatches_total", route=route, outcome="refused") == 2
    assert value(counts, "agentic_lora_dispatches_total", route=route, outcome="indeterminate") == 2


@pytest.mark.asyncio
async def test_a_cancelled_dispatch_counts_by_whether_it_may_have_left() -> None:
    metrics = Metrics()
    entered = asyncio.Event()

    async def endpoint(call: EngineCall) -> EngineReply:
        if call.body.get("route_first") and call.ticket is not None:
            call.ticket.engine = "e1"
        entered.set()
        await asyncio.Event().wait()  # held until cancelled
        raise AssertionError("unreachable")

    chain = build_chain(endpoint, [metrics.dispatch_middleware()])
    for routed in (False, True):
        entered.clear()
        task = asyncio.ensure_future(
            chain(
                EngineCall(
                    route=Route.COMPLETIONS, body={"route_first": routed}, ticket=InFlight(None)
                )
            )
        )
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    counts = parse(metrics.exposition().decode())
    route = Route.COMPLETIONS.value
    assert value(counts, "agentic_lora_dispatches_total", route=route, outcome="refused") == 1
    assert value(counts, "agentic_lora_dispatches_total", route=route, outcome="indeterminate") == 1


def test_phase_events_feed_the_histograms_by_phase_and_result() -> None:
    metrics = Metrics()
    hub = ProgressHub()
    hub.subscribe(metrics.observe_phase)
    hub(PhaseEvent("e0", Phase.PREPARE, PhaseStatus.STARTED))
    hub(PhaseEvent("e0", Phase.PREPARE, PhaseStatus.DONE, 0.25))
    hub(PhaseEvent("e1", Phase.PREPARE, PhaseStatus.FAILED, 0.5, "BACKEND_REFUSED"))
    hub(PhaseEvent("e0", Phase.RECLAIM, PhaseStatus.DONE, 12.0))
    hub(PhaseEvent(None, Phase.CLAIM_RECLAIM, PhaseStatus.DONE, 0.001))
    counts = parse(metrics.exposition().decode())
    name = "agentic_lora_publication_phase_seconds"
    assert value(counts, f"{name}_count", phase="prepare", result="ok") == 1
    assert value(counts, f"{name}_sum", phase="prepare", result="ok") == 0.25
    assert value(counts, f"{name}_count", phase="prepare", result="failed") == 1
    assert value(counts, "agentic_lora_reclaim_wait_seconds_sum", result="ok") == 12.0
    assert value(counts, "agentic_lora_reclaim_wait_seconds_bucket", result="ok", le="10.0") == 0
    assert value(counts, "agentic_lora_reclaim_wait_seconds_bucket", result="ok", le="30.0") == 1
    assert not any(dict(labels).get("phase") == "claim_reclaim" for _, labels in counts), (
        "claim_reclaim is a registry round trip, not a publication phase"
    )


def test_refused_requests_are_counted_by_the_code_of_bad_input_only() -> None:
    metrics = Metrics()
    name = "agentic_lora_gateway_refused_requests_total"
    fresh = parse(metrics.exposition().decode())
    # The closed label set exists from the start, at zero, and has no other label.
    assert {dict(labels)["code"] for (n, labels) in fresh if n == name} == {
        "INVALID_REQUEST",
        "REQUEST_TOO_LARGE",
        "ADAPTER_MISMATCH",
        "ACCESS_DENIED",
    }
    assert all(set(dict(labels)) == {"code"} for (n, labels) in fresh if n == name)
    assert metrics.observe_refused_request(InvalidRequestError("bad", reason="not_json"))
    assert metrics.observe_refused_request(InvalidRequestError("bad again"))
    assert metrics.observe_refused_request(RequestTooLargeError("big"))
    assert metrics.observe_refused_request(AdapterMismatchError("not yours"))
    assert metrics.observe_refused_request(AccessDeniedError("no id"))
    # Not the caller's input: an engine's refusal, an indeterminate run, an untyped failure.
    assert not metrics.observe_refused_request(RequestRefusedError("engine said no", status=400))
    assert not metrics.observe_refused_request(RequestIndeterminateError("lost"))
    assert not metrics.observe_refused_request(ValueError("bug"))
    counts = parse(metrics.exposition().decode())
    assert value(counts, name, code="INVALID_REQUEST") == 2
    assert value(counts, name, code="REQUEST_TOO_LARGE") == 1
    assert value(counts, name, code="ADAPTER_MISMATCH") == 1
    assert value(counts, name, code="ACCESS_DENIED") == 1
    assert {dict(labels)["code"] for (n, labels) in counts if n == name} == {
        dict(labels)["code"] for (n, labels) in fresh if n == name
    }


def test_two_metrics_objects_never_share_counters() -> None:
    first, second = Metrics(), Metrics()
    first.observe_dispatch(Route.GENERATE, DispatchOutcome.OK)
    route = Route.GENERATE.value
    ok_first = value(
        parse(first.exposition().decode()),
        "agentic_lora_dispatches_total",
        route=route,
        outcome="ok",
    )
    ok_second = value(
        parse(second.exposition().decode()),
        "agentic_lora_dispatches_total",
        route=route,
        outcome="ok",
    )
    assert (ok_first, ok_second) == (1, 0)


def test_a_failing_progress_listener_does_not_starve_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = ProgressHub()
    seen: list[PhaseEvent] = []

    def broken(event: PhaseEvent) -> None:
        raise ValueError("listener bug")

    hub.subscribe(broken)
    unsubscribe = hub.subscribe(seen.append)
    event = PhaseEvent("e0", Phase.COMMIT, PhaseStatus.DONE, 0.1)
    hub(event)
    assert seen == [event]
    [failure] = [r for r in caplog.records if r.exc_info is not None]
    assert (failure.exc_info[0], failure.engine) == (ValueError, "e0")  # type: ignore[index, attr-defined]
    unsubscribe()
    unsubscribe()  # idempotent
    hub(event)
    assert seen == [event]
    assert len(hub) == 1
