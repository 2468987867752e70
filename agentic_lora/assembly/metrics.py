"""Prometheus metrics for one deployment, fed by small observers on seams the core already has.

Nothing here changes a code path: each observer hangs on an existing hook.

| metric | type | labels | fed by |
| --- | --- | --- | --- |
| `agentic_lora_publications_total` | counter | outcome | `Metrics.observe_publication` / `observe_publication_error` |
| `agentic_lora_publication_errors_total` | counter | code | `Metrics.observe_publication_error` |
| `agentic_lora_publication_phase_seconds` | histogram | phase, result | progress events (`on_progress`) |
| `agentic_lora_reclaim_wait_seconds` | histogram | result | progress events (`on_progress`) |
| `agentic_lora_versions_reclaimed_total` | counter | | registry listener |
| `agentic_lora_registry_changes_total` | counter | verb | registry listener |
| `agentic_lora_dispatches_total` | counter | route, outcome | `DispatchMetricsMiddleware` |
| `agentic_lora_session_version_lag` | histogram | | `Metrics.watch_staleness` |
| `agentic_lora_version_too_stale_refusals_total` | counter | | `Metrics.watch_staleness` |
| `agentic_lora_gateway_refused_requests_total` | counter | code | `Metrics.observe_refused_request` |
| `agentic_lora_sessions_live` | gauge | | `Metrics.refresh` |
| `agentic_lora_registry_sessions` | gauge | | `Metrics.refresh` |
| `agentic_lora_bound_sessions` | gauge | version_state | `Metrics.refresh` |
| `agentic_lora_versions` | gauge | state | `Metrics.refresh` |
| `agentic_lora_capacity_slots` | gauge | | `Metrics.refresh` |
| `agentic_lora_capacity_slots_in_use` | gauge | | `Metrics.refresh` |
| `agentic_lora_default_revision` | gauge | | `Metrics.refresh` |

No label names a Session or a version: both are unbounded and would grow the series without end.
Every label value comes from a closed set (an enum or a stable error code). Durations are
seconds. ``agentic_lora_reclaim_wait_seconds`` is the per-engine reclaim call: unregister the
name, wait for the engine's own request refcount to drain, unload.

``agentic_lora_session_version_lag`` is observed once per versioned dispatch when it starts (the
refused ones included): how many publications the default is ahead of the Session's bound
version (a count, so no unit suffix). ``agentic_lora_version_too_stale_refusals_total`` counts
dispatches refused with ``VERSION_TOO_STALE`` (``max_version_lag``); those never reach the chain,
so ``agentic_lora_dispatches_total`` does not count them.

``agentic_lora_gateway_refused_requests_total`` counts generation requests the gateway refused
for the caller's own input (:data:`BAD_INPUT_CODES`: a malformed or oversized body, a model
name that is no Session's adapter, a missing credential), by the error's stable code. Most never
open a Session, so ``agentic_lora_dispatches_total`` does not see them.

The instruments live in their own :class:`prometheus_client.CollectorRegistry` (not the global
one), so two deployments in one process, or two tests, never share counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import (
    AccessDeniedError,
    AdapterMismatchError,
    AgenticLoRAError,
    InvalidRequestError,
    RequestTooLargeError,
)
from agentic_lora.foundation.outcomes import DispatchOutcome, classify_failure
from agentic_lora.foundation.phases import Phase, PhaseEvent, PhaseStatus
from agentic_lora.foundation.requests import Route
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.types import RegistryStatus, VersionState, VersionStatus
from agentic_lora.session.middleware import Dispatch, EngineCall, Middleware

if TYPE_CHECKING:
    from agentic_lora.session import Versioning

__all__ = ["BAD_INPUT_CODES", "PUBLICATION_PHASES", "DispatchMetricsMiddleware", "Metrics"]

logger = logging.getLogger(__name__)

PREFIX = "agentic_lora"

#: Phases whose durations go to ``agentic_lora_publication_phase_seconds``.
PUBLICATION_PHASES: frozenset[Phase] = frozenset(
    {
        Phase.RESERVE,
        Phase.OBSERVE,
        Phase.PREPARE,
        Phase.RECORD_READY,
        Phase.COMMIT,
        Phase.ABORT,
        Phase.CLEANUP,
        Phase.CONFIRM_CLEANUP,
    }
)

#: The stable codes of the errors that refuse a request for the caller's own input: the closed
#: label set of ``agentic_lora_gateway_refused_requests_total``.
BAD_INPUT_CODES: frozenset[str] = frozenset(
    {
        InvalidRequestError.code,
        RequestTooLargeError.code,
        AdapterMismatchError.code,
        AccessDeniedError.code,
    }
)

# From a registry round trip (milliseconds) to a slow adapter load (minutes).
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# A reclaim waits for the longest in-flight generation on the version: up to many minutes.
_RECLAIM_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# Lags are whole publications; staleness bounds in RL loops are small (typically 0-8).
_LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


class Metrics:
    """The deployment's Prometheus instruments and the observers that feed them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.publications = Counter(
            f"{PREFIX}_publications",
            "Publications by how they ended (published, already_published, skipped, "
            "failed_clean, blocked, error).",
            ["outcome"],
            registry=r,
        )
        self.publication_errors = Counter(
            f"{PREFIX}_publication_errors",
            "Publications that raised a typed error, by its stable code.",
            ["code"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            f"{PREFIX}_publication_phase_seconds",
            "Time spent in one publication phase on one engine (or fleet-wide).",
            ["phase", "result"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.reclaim_wait_seconds = Histogram(
            f"{PREFIX}_reclaim_wait_seconds",
            "Per-engine reclaim: unregister, wait for in-flight requests to drain, unload.",
            ["result"],
            buckets=_RECLAIM_BUCKETS,
            registry=r,
        )
        self.versions_reclaimed = Counter(
            f"{PREFIX}_versions_reclaimed",
            "Versions unloaded from every engine (their capacity slot freed).",
            registry=r,
        )
        self.registry_changes = Counter(
            f"{PREFIX}_registry_changes",
            "State changes applied by the registry, by verb (replays excluded).",
            ["verb"],
            registry=r,
        )
        self.dispatches = Counter(
            f"{PREFIX}_dispatches",
            "Generations by route and outcome: ok, refused (provably not accepted) or "
            "indeterminate (may have run).",
            ["route", "outcome"],
            registry=r,
        )
        self.sessions_live = Gauge(
            f"{PREFIX}_sessions_live",
            "Sessions open in this process (bound or not yet bound).",
            registry=r,
        )
        self.registry_sessions = Gauge(
            f"{PREFIX}_registry_sessions",
            "Session records the registry holds that are not closed (all workers).",
            registry=r,
        )
        self.bound_sessions = Gauge(
            f"{PREFIX}_bound_sessions",
            "Session references held on versions, by the state of the version.",
            ["version_state"],
            registry=r,
        )
        self.versions = Gauge(
            f"{PREFIX}_versions",
            "Versions the registry knows, by state.",
            ["state"],
            registry=r,
        )
        self.capacity_slots = Gauge(
            f"{PREFIX}_capacity_slots",
            "Versions the fleet may hold at once (the registry's capacity).",
            registry=r,
        )
        self.capacity_slots_in_use = Gauge(
            f"{PREFIX}_capacity_slots_in_use",
            "Capacity slots held (LOADING, PUBLISHED, RETIRED, RECLAIMING, unconfirmed ABORTED).",
            registry=r,
        )
        self.default_revision = Gauge(
            f"{PREFIX}_default_revision",
            "How many times the default version has changed.",
            registry=r,
        )
        self.version_lag = Histogram(
            f"{PREFIX}_session_version_lag",
            "Publications the default is ahead of a Session's bound version, at each dispatch.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.version_too_stale = Counter(
            f"{PREFIX}_version_too_stale_refusals",
            "Dispatches refused with VERSION_TOO_STALE (bound version beyond max_version_lag).",
            registry=r,
        )
        self.refused_requests = Counter(
            f"{PREFIX}_gateway_refused_requests",
            "Generation requests the gateway refused for the caller's own input, by error code.",
            ["code"],
            registry=r,
        )
        # Every series of a closed label set exists from the start, at zero, so a rate() over a
        # fresh process is not missing the series it is about to see.
        for route in Route:
            for outcome in DispatchOutcome:
                self.dispatches.labels(route=route.value, outcome=outcome.value)
        for code in sorted(BAD_INPUT_CODES):
            self.refused_requests.labels(code=code)
        for state in VersionState:
            self.versions.labels(state=state.value.lower())
            self.bound_sessions.labels(version_state=state.value.lower())

    # --- observers ------------------------------------------------------------------------------

    def observe_phase(self, event: PhaseEvent) -> None:
        """A publisher/reclaimer progress event (hook it on ``on_progress``)."""
        if event.status is PhaseStatus.STARTED or event.seconds is None:
            return
        result = "ok" if event.status is PhaseStatus.DONE else "failed"
        if event.phase in PUBLICATION_PHASES:
            self.phase_seconds.labels(phase=event.phase.value, result=result).observe(event.seconds)
        elif event.phase is Phase.RECLAIM:
            self.reclaim_wait_seconds.labels(result=result).observe(event.seconds)

    def observe_publication(self, result: PublicationResult) -> None:
        """A publication that returned a result."""
        self.publications.labels(outcome=result.outcome.value.lower()).inc()

    def observe_publication_error(self, error: BaseException) -> None:
        """A publication that raised: a typed error's code, else ``AGENTIC_LORA_ERROR`` (an
        exception's type name would make the label set open-ended)."""
        code = error.code if isinstance(error, AgenticLoRAError) else "AGENTIC_LORA_ERROR"
        self.publications.labels(outcome="error").inc()
        self.publication_errors.labels(code=code).inc()

    def on_registry_change(self, verb: str, result: Any) -> None:
        """A ``LocalRegistry`` listener: called after every applied state change."""
        self.registry_changes.labels(verb=verb).inc()
        if (
            verb == "confirm_reclaim"
            and isinstance(result, VersionStatus)
            and result.state is VersionState.RECLAIMED
        ):
            self.versions_reclaimed.inc()

    def observe_dispatch(self, route: Route, outcome: DispatchOutcome) -> None:
        """One generation that ended with ``outcome``."""
        self.dispatches.labels(route=route.value, outcome=outcome.value).inc()

    def observe_refused_request(self, error: BaseException) -> bool:
        """A failed generation request: counted (True) when ``error`` refused it for the
        caller's own input (its code in :data:`BAD_INPUT_CODES`), ignored otherwise."""
        if not isinstance(error, AgenticLoRAError) or error.code not in BAD_INPUT_CODES:
            return False
        self.refused_requests.labels(code=error.code).inc()
        return True

    def observe_version_lag(self, lag: int) -> None:
        """The lag of one versioned dispatch at its start (a ``StalenessListener`` hook)."""
        self.version_lag.observe(lag)

    def observe_version_too_stale(self, lag: int) -> None:
        """One ``VERSION_TOO_STALE`` refusal (a ``StalenessListener`` hook)."""
        self.version_too_stale.inc()

    def refresh(self, status: RegistryStatus, *, live_sessions: int) -> None:
        """Set the gauges from a registry status (call it right before a scrape)."""
        self.sessions_live.set(live_sessions)
        self.registry_sessions.set(status.live_sessions)
        self.capacity_slots.set(status.capacity)
        self.capacity_slots_in_use.set(status.slots_in_use)
        self.default_revision.set(status.default_revision)
        versions: Tally[VersionState] = Tally()
        refs: Tally[VersionState] = Tally()
        for v in status.versions:
            versions[v.state] += 1
            refs[v.state] += v.session_refs
        for state in VersionState:
            self.versions.labels(state=state.value.lower()).set(versions[state])
            self.bound_sessions.labels(version_state=state.value.lower()).set(refs[state])

    # --- hooks ----------------------------------------------------------------------------------

    def dispatch_middleware(self) -> Middleware:
        """The chain middleware that counts dispatch outcomes (list it first in the chain)."""
        return Middleware(DispatchMetricsMiddleware, metrics=self)

    def watch_staleness(self, versioning: Versioning) -> None:
        """Observe the lag of every dispatch of ``versioning``'s Sessions and their refusals."""
        versioning.staleness_listeners.append(self)

    def watch_registry(self, registry: object) -> bool:
        """Listen to ``registry`` if it offers ``add_listener`` (``LocalRegistry`` does)."""
        feed = change_feed(registry)
        if feed is None:
            return False
        feed.add_listener(self.on_registry_change)
        return True

    # --- exposition -----------------------------------------------------------------------------

    @property
    def content_type(self) -> str:
        """The media type of :meth:`exposition` (Prometheus text format)."""
        return str(CONTENT_TYPE_LATEST)

    def exposition(self) -> bytes:
        """Every instrument in the Prometheus text format."""
        return bytes(generate_latest(self.registry))


class DispatchMetricsMiddleware:
    """Counts each dispatch once, by route and outcome; never changes the call or its result.

    Listed first in the chain it sees every refusal raised below it (adapter pin, dispatch
    guard, routing) as well as the transport's classified failures. A cancellation counts as
    ``indeterminate`` once the router chose an engine (the request may have left), else as
    ``refused``.
    """

    def __init__(self, next_dispatch: Dispatch, *, metrics: Metrics) -> None:
        self._next = next_dispatch
        self._metrics = metrics

    async def __call__(self, call: EngineCall) -> EngineReply:
        try:
            reply = await self._next(call)
        except (Exception, asyncio.CancelledError) as exc:
            sent = call.ticket is not None and call.ticket.engine is not None
            self._metrics.observe_dispatch(call.route, classify_failure(exc, sent=sent))
            raise
        self._metrics.observe_dispatch(call.route, DispatchOutcome.OK)
        return reply
