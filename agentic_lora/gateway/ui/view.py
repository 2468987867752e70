"""The status page's data: one JSON-able view built from a registry status and gateway state.

I/O-free: :func:`build_view` takes everything it shows as arguments (the registry's
:class:`~agentic_lora.registry.types.RegistryStatus`, the engines' readiness, the gateway's Session
counts, the :mod:`~agentic_lora.gateway.ui.activity` records, the dispatch-lag histogram) and
returns plain dicts and lists, so it is unit-tested without a server and benchmarked alone.

Its size does not grow with the number of Sessions: Sessions appear only as counts (per
version, per version state, per lag, per lease). Versions and leases are paged
(:class:`ViewQuery`); by default the versions page holds only versions that still matter (not
RECLAIMED or FAILED_CLEAN), newest first; every state's count is always given. The timeline
lists the last few operations, only the newest ones with every step (the bulk of an update).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.identity import DIGEST_PREFIX_LENGTH
from agentic_lora.gateway.ui.activity import Operation
from agentic_lora.gateway.ui.activity import RefusalLog
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus

__all__ = [
    "MAX_PAGE",
    "GatewayFacts",
    "LagHistogram",
    "ViewQuery",
    "build_view",
    "lag_histogram",
]

#: The largest page a query may ask for (versions or leases).
MAX_PAGE = 200
#: Versions that no longer hold anything: hidden unless a query asks for every version.
_HISTORY = frozenset({VersionState.RECLAIMED, VersionState.FAILED_CLEAN})
#: How many recent refusals a view lists (the tally per code counts them all).
_RECENT_REFUSALS = 20
#: How many recent operations a view lists, and of those how many with every step.
_RECENT_OPERATIONS = 8
_DETAILED_OPERATIONS = 3
#: Fields an engine row has in its own columns; any other field of the registry's engine or
#: member status (membership state, fence, ...) is shown as it comes, under ``extra``.
_ENGINE_CORE_FIELDS = frozenset({"engine", "incarnation", "base_url", "membership"})


@dataclass(frozen=True, slots=True)
class ViewQuery:
    """Which page of versions and of leases a view holds.

    ``all_versions``: include RECLAIMED and FAILED_CLEAN versions. Offsets past the end give an
    empty page (the totals still say how many there are).
    """

    versions_offset: int = 0
    versions_limit: int = 25
    all_versions: bool = False
    leases_offset: int = 0
    leases_limit: int = 10

    def __post_init__(self) -> None:
        for name in ("versions_offset", "leases_offset"):
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"`{name}` must not be negative", field=name)
        for name in ("versions_limit", "leases_limit"):
            if not 1 <= getattr(self, name) <= MAX_PAGE:
                raise InvalidRequestError(f"`{name}` must be 1-{MAX_PAGE}", field=name)

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> ViewQuery:
        """A query from URL parameters (the names of the fields; ``all_versions`` is ``1`` or
        ``0``); a missing one takes its default, a malformed one is INVALID_REQUEST."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = params.get(f.name)
            if raw is None:
                continue
            if f.name == "all_versions":
                if raw not in ("0", "1"):
                    raise InvalidRequestError("`all_versions` must be 0 or 1", field=f.name)
                values[f.name] = raw == "1"
                continue
            if not raw.isdigit() or len(raw) > 9:
                raise InvalidRequestError(f"`{f.name}` must be a whole number", field=f.name)
            values[f.name] = int(raw)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class GatewayFacts:
    """What the gateway itself knows beside the registry.

    ``sessions``: Sessions open in this gateway; ``adopted``: of those, adopted from its previous
    incarnation. ``engine_health``: each engine's last probe (True: it answered); ``ready`` and
    ``reasons``: the gateway's readiness (``/health/ready``).
    """

    sessions: int
    adopted: int
    engine_health: Mapping[str, bool]
    ready: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LagHistogram:
    """A cumulative histogram of dispatch lags: ``buckets`` are (upper bound, dispatches at or
    below it), the last one ``+Inf``."""

    buckets: tuple[tuple[str, float], ...]
    count: float
    total: float


def lag_histogram(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> LagHistogram:
    """A :class:`LagHistogram` from a Prometheus histogram's samples (name, labels, value)."""
    buckets: list[tuple[str, float]] = []
    count = total = 0.0
    for name, labels, value in samples:
        if name.endswith("_bucket"):
            buckets.append((labels["le"], value))
        elif name.endswith("_count"):
            count = value
        elif name.endswith("_sum"):
            total = value
    return LagHistogram(tuple(buckets), count, total)


def build_view(
    status: RegistryStatus,
    gateway: GatewayFacts,
    *,
    operations: Sequence[Operation] = (),
    refusals: RefusalLog | None = None,
    dispatch_lag: LagHistogram | None = None,
    query: ViewQuery | None = None,
    now: float,
) -> dict[str, Any]:
    """Everything the status page shows, read at ``now`` (wall-clock seconds: the clock of the
    registry's lease deadlines and of the activity records)."""
    query = query if query is not None else ViewQuery()
    return {
        "at": _ms(now),
        "summary": _summary(status, gateway),
        "versions": _versions(status, query),
        "engines": _engines(status, gateway.engine_health),
        "staleness": _staleness(status, dispatch_lag),
        "timeline": [
            _operation(op, detailed=n < _DETAILED_OPERATIONS)
            for n, op in enumerate(operations[:_RECENT_OPERATIONS])
        ],
        "refusals": _refusals(refusals),
        "leases": _leases(status, query),
    }


def _ms(seconds: float | None) -> float | None:
    """Times to the millisecond: finer is noise on a page, and bytes on every update."""
    return None if seconds is None else round(seconds, 3)


def _summary(status: RegistryStatus, gateway: GatewayFacts) -> dict[str, Any]:
    return {
        "default_version": status.default_version,
        "default_revision": status.default_revision,
        "rolled_back_from": status.rolled_back_from,
        "pending_version": status.pending_version,
        "capacity": status.capacity,
        "slots_in_use": status.slots_in_use,
        "deployment_epoch": status.deployment_epoch,
        "registry_sessions": status.live_sessions,
        "named_sessions": status.named_sessions,
        "gateway_sessions": gateway.sessions,
        "adopted_sessions": gateway.adopted,
        "ready": gateway.ready,
        "reasons": list(gateway.reasons),
    }


def _lag(status: RegistryStatus, v: VersionStatus) -> int | None:
    """Default changes since ``v`` was committed (None: never committed)."""
    if v.published_revision is None:
        return None
    return max(0, status.default_revision - v.published_revision)


def _versions(status: RegistryStatus, query: ViewQuery) -> dict[str, Any]:
    by_state: Counter[str] = Counter()
    sessions_by_state: Counter[str] = Counter()
    for v in status.versions:
        by_state[v.state.value] += 1
        sessions_by_state[v.state.value] += v.session_refs
    shown = [v for v in reversed(status.versions) if query.all_versions or v.state not in _HISTORY]
    page = shown[query.versions_offset : query.versions_offset + query.versions_limit]
    return {
        "total": len(status.versions),
        "matching": len(shown),
        "offset": query.versions_offset,
        "limit": query.versions_limit,
        "all": query.all_versions,
        "by_state": {s.value: by_state[s.value] for s in VersionState},
        "sessions_by_state": {s.value: sessions_by_state[s.value] for s in VersionState},
        "rows": [
            {
                "version_id": v.version_id,
                "state": v.state.value,
                "default": v.version_id == status.default_version,
                "digest": v.digest[:DIGEST_PREFIX_LENGTH],
                "lora_name": v.lora_name,
                "attempt": v.attempt,
                "sessions": v.session_refs,
                "lag": _lag(status, v),
                "ready_engines": list(v.ready_engines),
            }
            for v in page
        ],
    }


def _engines(status: RegistryStatus, health: Mapping[str, bool]) -> list[dict[str, Any]]:
    """One row per engine of the fleet, and per member the registry's membership adds (an
    engine that joined at runtime). A member's fields are read by name, so a registry without
    a membership shows none."""
    members = {m.engine: m for m in getattr(status, "members", ())}
    engines = {e.engine: e for e in status.engines}
    rows = []
    for name in [*engines, *(m for m in members if m not in engines)]:
        sources = [s for s in (engines.get(name), members.get(name)) if s is not None]
        extra: dict[str, Any] = {}
        incarnation = None
        membership = None
        for source in sources:
            incarnation = incarnation or getattr(source, "incarnation", None)
            membership = membership or _plain(getattr(source, "membership", None))
            for f in dataclasses.fields(source):
                if f.name not in _ENGINE_CORE_FIELDS:
                    extra[f.name] = _plain(getattr(source, f.name))
        held = [v for v in status.versions if v.state.holds_slot and name in _holders(v)]
        rows.append(
            {
                "engine": name,
                "incarnation": incarnation,
                "healthy": health.get(name),
                "slots_used": len(held),
                "adapters": [{"version_id": v.version_id, "state": v.state.value} for v in held],
                "membership": membership,
                "extra": extra,
            }
        )
    return rows


def _holders(v: VersionStatus) -> tuple[str, ...]:
    """The engines holding ``v``: every member with a current READY when the registry says
    (``held_by``), else the engines a request may be routed to."""
    held_by: tuple[str, ...] = getattr(v, "held_by", ()) or v.held_engines
    return held_by or v.ready_engines


def _plain(value: Any) -> Any:
    """A JSON-able form of a status field whose type this module does not know."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list | frozenset | set):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _staleness(status: RegistryStatus, dispatch_lag: LagHistogram | None) -> dict[str, Any]:
    sessions_by_lag: Counter[int] = Counter()
    for v in status.versions:
        lag = _lag(status, v)
        if lag is not None and v.session_refs:
            sessions_by_lag[lag] += v.session_refs
    return {
        "sessions_by_lag": [list(item) for item in sorted(sessions_by_lag.items())],
        "dispatches": None
        if dispatch_lag is None
        else {
            "buckets": [list(b) for b in dispatch_lag.buckets],
            "count": dispatch_lag.count,
            "sum": dispatch_lag.total,
        },
    }


def _operation(op: Operation, *, detailed: bool) -> dict[str, Any]:
    return {
        "seq": op.seq,
        "kind": op.kind.value,
        "version_id": op.version_id,
        "started_at": _ms(op.started_at),
        "updated_at": _ms(op.updated_at),
        "outcome": op.outcome,
        "error_code": op.error_code,
        "dropped": op.dropped,
        "step_count": len(op.steps),
        "steps": [
            {
                "phase": s.phase.value,
                "engine": s.engine,
                "status": s.status.value,
                "at": _ms(s.at),
                "seconds": _ms(s.seconds),
                "error_code": s.error_code,
            }
            for s in (op.steps if detailed else ())
        ],
    }


def _refusals(log: RefusalLog | None) -> dict[str, Any]:
    if log is None:
        return {"total": 0, "by_code": {}, "by_outcome": {}, "recent": []}
    return {
        "total": log.total,
        "by_code": dict(log.by_code.most_common()),
        "by_outcome": {o.value: n for o, n in log.by_outcome.items()},
        "recent": [
            {"at": _ms(r.at), "code": r.code, "outcome": r.outcome.value, "route": r.route}
            for r in log.recent()[:_RECENT_REFUSALS]
        ],
    }


def _leases(status: RegistryStatus, query: ViewQuery) -> dict[str, Any]:
    ordered = sorted(status.leases, key=lambda lease: (-lease.sessions, lease.owner))
    page = ordered[query.leases_offset : query.leases_offset + query.leases_limit]
    return {
        "total": len(ordered),
        "offset": query.leases_offset,
        "limit": query.leases_limit,
        "sessions": sum(lease.sessions for lease in ordered),
        "rows": [
            {
                "owner": lease.owner,
                "incarnation": lease.incarnation,
                "sessions": lease.sessions,
                "names": lease.names,
                "ttl": lease.ttl,
                "expires_at": _ms(lease.expires_at),
            }
            for lease in page
        ],
    }
