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
| `agentic_lora_dispatch_seconds` | histogram | route, outcome | `DispatchMetricsMiddleware` |
| `agentic_lora_gateway_failed_requests_total` | counter | code | `Metrics.observe_failed_request` |
| `agentic_lora_leases_expired_total` | counter | | registry listener |
| `agentic_lora_lease_expired_sessions_total` | counter | | registry listener |
| `agentic_lora_engine_up` | gauge | engine | `Metrics.refresh` |
| `agentic_lora_engine_members` | gauge | member_state | `Metrics.refresh` |

Each row is one :class:`Instrument` declared on :class:`Metrics` (:data:`CATALOGUE` lists them);
a test holds this table and the metrics table of the gateway docs to that catalogue.

No label names a Session or a version: both are unbounded and would grow the series without end.
Every label value comes from a closed set (an enum or a stable error code), but ``engine``: the
fleet's engine names, as many as the operator configured. Durations are seconds.
``agentic_lora_reclaim_wait_seconds`` is the per-engine reclaim call: unregister the
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

``agentic_lora_gateway_failed_requests_total`` counts every failed generation request by code
(``AGENTIC_LORA_ERROR``: untyped). The lease counters hear a registry in this process.

The instruments live in their own :class:`prometheus_client.CollectorRegistry` (not the global
one), so two deployments in one process, or two tests, never share counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any
from typing import Generic
from typing import TypeVar
from typing import overload

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import CollectorRegistry
from prometheus_client import Counter
from prometheus_client import Gauge
from prometheus_client import Histogram
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestTooLargeError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.outcomes import classify_failure
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.foundation.requests import Route
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import Middleware

if TYPE_CHECKING:
    from agentic_lora.session import Versioning

__all__ = [
    "BAD_INPUT_CODES",
    "CATALOGUE",
    "PUBLICATION_PHASES",
    "DispatchMetricsMiddleware",
    "Instrument",
    "Metrics",
]

logger = logging.getLogger(__name__)

PREFIX = "agentic_lora"

_M = TypeVar("_M", bound=MetricWrapperBase)

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
        Phase.RESERVE_ROLLBACK,
        Phase.ROLLBACK,
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
# From a short tool-call turn to a long rollout generation on a loaded engine.
_DISPATCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Lags are whole publications; staleness bounds in RL loops are small (typically 0-8).
_LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


class Instrument(Generic[_M]):
    """One entry of the catalogue: a Prometheus instrument, declared as a :class:`Metrics`
    attribute named like the metric (without the prefix and a counter's ``_total``).

    Read on the class it is the declaration (what :data:`CATALOGUE` lists and the docs are
    checked against); read on a :class:`Metrics` it is that object's own instrument.
    """

    def __init__(
        self,
        kind: type[_M],
        labels: tuple[str, ...],
        help_text: str,
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.kind = kind
        self.labels = labels
        self.help = help_text
        self.buckets = buckets
        self.name = ""

    def __set_name__(self, owner: type[Metrics], name: str) -> None:
        self.name = name

    @property
    def exposed(self) -> str:
        """The metric's name on a scrape (prometheus_client gives a counter ``_total``)."""
        suffix = "_total" if self.kind is Counter else ""
        return f"{PREFIX}_{self.name}{suffix}"

    def build(self, registry: CollectorRegistry) -> _M:
        """A new instrument of this declaration, registered in ``registry``."""
        extra: dict[str, Any] = {"buckets": self.buckets} if self.buckets else {}
        return self.kind(
            f"{PREFIX}_{self.name}", self.help, self.labels, registry=registry, **extra
        )

    @overload
    def __get__(self, metrics: None, owner: type[Metrics]) -> Instrument[_M]: ...
    @overload
    def __get__(self, metrics: Metrics, owner: type[Metrics]) -> _M: ...
    def __get__(self, metrics: Metrics | None, owner: type[Metrics]) -> Instrument[_M] | _M:
        if metrics is None:
            return self
        instrument: _M = metrics._instruments[self.name]
        return instrument


class Metrics:
    """The deployment's Prometheus instruments and the observers that feed them."""

    # --- the catalogue --------------------------------------------------------------------------

    publications = Instrument(
        Counter,
        ("outcome",),
        "Publications by how they ended (published, already_published, skipped, "
        "failed_clean, blocked, error).",
    )
    publication_errors = Instrument(
        Counter, ("code",), "Publications that raised a typed error, by its stable code."
    )
    publication_phase_seconds = Instrument(
        Histogram,
        ("phase", "result"),
        "Time spent in one publication phase on one engine (or fleet-wide).",
        _PHASE_BUCKETS,
    )
    reclaim_wait_seconds = Instrument(
        Histogram,
        ("result",),
        "Per-engine reclaim: unregister, wait for in-flight requests to drain, unload.",
        _RECLAIM_BUCKETS,
    )
    versions_reclaimed = Instrument(
        Counter, (), "Versions unloaded from every engine (their capacity slot freed)."
    )
    registry_changes = Instrument(
        Counter, ("verb",), "State changes applied by the registry, by verb (replays excluded)."
    )
    dispatches = Instrument(
        Counter,
        ("route", "outcome"),
        "Generations by route and outcome: ok, refused (provably not accepted) or "
        "indeterminate (may have run).",
    )
    sessions_live = Instrument(Gauge, (), "Sessions open in this process (bound or not yet bound).")
    registry_sessions = Instrument(
        Gauge, (), "Session records the registry holds that are not closed (all workers)."
    )
    bound_sessions = Instrument(
        Gauge,
        ("version_state",),
        "Session references held on versions, by the state of the version.",
    )
    versions = Instrument(Gauge, ("state",), "Versions the registry knows, by state.")
    capacity_slots = Instrument(
        Gauge, (), "Versions the fleet may hold at once (the registry's capacity)."
    )
    capacity_slots_in_use = Instrument(
        Gauge,
        (),
        "Capacity slots held (LOADING, PUBLISHED, RETIRED, RECLAIMING, unconfirmed ABORTED).",
    )
    default_revision = Instrument(Gauge, (), "How many times the default version has changed.")
    session_version_lag = Instrument(
        Histogram,
        (),
        "Publications the default is ahead of a Session's bound version, at each dispatch.",
        _LAG_BUCKETS,
    )
    version_too_stale_refusals = Instrument(
        Counter,
        (),
        "Dispatches refused with VERSION_TOO_STALE (bound version beyond max_version_lag).",
    )
    gateway_refused_requests = Instrument(
        Counter,
        ("code",),
        "Generation requests the gateway refused for the caller's own input, by error code.",
    )

    dispatch_seconds = Instrument(
        Histogram, ("route", "outcome"), "Time one dispatch spent in the chain.", _DISPATCH_BUCKETS
    )
    gateway_failed_requests = Instrument(
        Counter, ("code",), "Generation requests answered with an error, by its stable code."
    )
    leases_expired = Instrument(Counter, (), "Owner leases the registry's sweep expired.")
    lease_expired_sessions = Instrument(
        Counter, (), "Sessions whose version refs were released because their lease expired."
    )
    engine_up = Instrument(
        Gauge, ("engine",), "Whether the engine answered its last incarnation probe (1) or not."
    )
    engine_members = Instrument(
        Gauge, ("member_state",), "Fleet members by membership state (when the registry has one)."
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # Each Metrics builds its own instruments in its own registry: two never share a series.
        self._instruments: dict[str, Any] = {
            spec.name: spec.build(self.registry) for spec in CATALOGUE
        }
        # Every series of a closed label set exists from the start, at zero, so a rate() over a
        # fresh process is not missing the series it is about to see.
        for route in Route:
            for outcome in DispatchOutcome:
                self.dispatches.labels(route=route.value, outcome=outcome.value)
                self.dispatch_seconds.labels(route=route.value, outcome=outcome.value)
        for code in sorted(BAD_INPUT_CODES):
            self.gateway_refused_requests.labels(code=code)
        for state in VersionState:
            self.versions.labels(state=state.value.lower())
            self.bound_sessions.labels(version_state=state.value.lower())
        self._engines_up: set[str] = set()
        self._member_states: set[str] = set()

    # --- observers ------------------------------------------------------------------------------

    def observe_phase(self, event: PhaseEvent) -> None:
        """A publisher/reclaimer progress event (hook it on ``on_progress``)."""
        if event.status is PhaseStatus.STARTED or event.seconds is None:
            return
        result = "ok" if event.status is PhaseStatus.DONE else "failed"
        if event.phase in PUBLICATION_PHASES:
            self.publication_phase_seconds.labels(phase=event.phase.value, result=result).observe(
                event.seconds
            )
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
        elif verb == "sweep" and isinstance(result, SweepResult):
            self.leases_expired.inc(len(result.expired_leases))
            self.lease_expired_sessions.inc(len(result.expired_sessions))

    def observe_dispatch(
        self, route: Route, outcome: DispatchOutcome, seconds: float | None = None
    ) -> None:
        """One generation that ended with ``outcome`` after ``seconds`` in the chain."""
        self.dispatches.labels(route=route.value, outcome=outcome.value).inc()
        if seconds is not None:
            self.dispatch_seconds.labels(route=route.value, outcome=outcome.value).observe(seconds)

    def observe_refused_request(self, error: BaseException) -> bool:
        """A failed generation request: counted (True) when ``error`` refused it for the
        caller's own input (its code in :data:`BAD_INPUT_CODES`), ignored otherwise."""
        if not isinstance(error, AgenticLoRAError) or error.code not in BAD_INPUT_CODES:
            return False
        self.gateway_refused_requests.labels(code=error.code).inc()
        return True

    def observe_failed_request(self, error: BaseException) -> None:
        """A generation request the gateway answered with an error (whatever the error)."""
        code = error.code if isinstance(error, AgenticLoRAError) else "AGENTIC_LORA_ERROR"
        self.gateway_failed_requests.labels(code=code).inc()

    def observe_version_lag(self, lag: int) -> None:
        """The lag of one versioned dispatch at its start (a ``StalenessListener`` hook)."""
        self.session_version_lag.observe(lag)

    def observe_version_too_stale(self, lag: int) -> None:
        """One ``VERSION_TOO_STALE`` refusal (a ``StalenessListener`` hook)."""
        self.version_too_stale_refusals.inc()

    def refresh(
        self,
        status: RegistryStatus,
        *,
        live_sessions: int,
        engine_health: Mapping[str, bool] | None = None,
    ) -> None:
        """Set the gauges from a registry status and the engines' last probes (before a scrape)."""
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
        if engine_health is not None:
            self._engines_up = self._set_each(self.engine_up, self._engines_up, engine_health)
        # The registry's membership: each engine's state (a status without one counts none).
        members: Tally[str] = Tally(
            str(getattr(m.state, "value", m.state)).lower() for m in getattr(status, "members", ())
        ) or Tally(e.membership.value.lower() for e in status.engines)
        self._member_states = self._set_each(self.engine_members, self._member_states, members)

    @staticmethod
    def _set_each(gauge: Gauge, before: set[str], values: Mapping[str, float]) -> set[str]:
        """One series per key of ``values``; the series of keys gone since are removed."""
        for gone in before - set(values):
            gauge.remove(gone)
        for key, value in values.items():
            gauge.labels(key).set(float(value))
        return set(values)

    # --- hooks ----------------------------------------------------------------------------------

    def dispatch_middleware(self, clock: Callable[[], float] = time.perf_counter) -> Middleware:
        """The chain middleware that counts and times dispatches (list it first in the chain)."""
        return Middleware(DispatchMetricsMiddleware, metrics=self, clock=clock)

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


#: Every instrument a :class:`Metrics` exposes, in declaration order.
CATALOGUE: tuple[Instrument[Any], ...] = tuple(
    spec for spec in vars(Metrics).values() if isinstance(spec, Instrument)
)


class DispatchMetricsMiddleware:
    """Counts each dispatch once, by route and outcome; never changes the call or its result.

    Listed first in the chain it sees every refusal raised below it (adapter pin, dispatch
    guard, routing) as well as the transport's classified failures. A cancellation counts as
    ``indeterminate`` once the router chose an engine (the request may have left), else as
    ``refused``.
    """

    def __init__(
        self,
        next_dispatch: Dispatch,
        *,
        metrics: Metrics,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._next = next_dispatch
        self._metrics = metrics
        self._clock = clock

    async def __call__(self, call: EngineCall) -> EngineReply:
        clock = self._clock
        start = clock()
        try:
            reply = await self._next(call)
        except (Exception, asyncio.CancelledError) as exc:
            sent = call.ticket is not None and call.ticket.engine is not None
            outcome = classify_failure(exc, sent=sent)
            self._metrics.observe_dispatch(call.route, outcome, clock() - start)
            raise
        self._metrics.observe_dispatch(call.route, DispatchOutcome.OK, clock() - start)
        return reply
