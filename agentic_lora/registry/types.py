"""Values the registry takes and returns: states, receipts, bindings, status.

All are frozen (immutable) so a result handed to one caller can be handed to a replaying caller
as-is; ``to_wire``/``from_wire`` give the JSON form used by the journal and the Ray client.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "Binding",
    "CommitReceipt",
    "DispatchView",
    "EngineStatus",
    "LeaseGrant",
    "LeaseStatus",
    "NamedSession",
    "ReadyReceipt",
    "ReclaimClaim",
    "RegistryStatus",
    "ReleaseResult",
    "Reservation",
    "ReserveOutcome",
    "SessionState",
    "SessionStatus",
    "SweepResult",
    "VersionKey",
    "VersionState",
    "VersionStatus",
    "new_request_id",
]


def new_request_id() -> str:
    """Mint an idempotency key for one logical registry call (reuse it when replaying)."""
    return uuid.uuid4().hex


class VersionState(enum.StrEnum):
    LOADING = "LOADING"
    PUBLISHED = "PUBLISHED"
    RETIRED = "RETIRED"
    RECLAIMING = "RECLAIMING"
    RECLAIMED = "RECLAIMED"
    ABORTED = "ABORTED"
    FAILED_CLEAN = "FAILED_CLEAN"

    @property
    def holds_slot(self) -> bool:
        """A version holds one capacity slot until it is RECLAIMED or FAILED_CLEAN."""
        return self not in (VersionState.RECLAIMED, VersionState.FAILED_CLEAN)

    @property
    def dispatchable(self) -> bool:
        """Only these states may receive generation requests (a bound Session's version)."""
        return self in (VersionState.PUBLISHED, VersionState.RETIRED)


class SessionState(enum.StrEnum):
    """The registry's view of a Session (the middleware has its own, finer one).

    CLOSED and EXPIRED are both tombstones: the ref is gone and nothing can bind the key again.
    CLOSED came from the Session's own close; EXPIRED from its owner's lease (it expired, the
    owner restarted, or the owner closed its lease with the Session still open).
    """

    BOUND = "BOUND"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"
    EXPIRED = "EXPIRED"

    @property
    def holds_ref(self) -> bool:
        """Whether a Session in this state still holds its version's ref (BOUND or CLOSING)."""
        return self in (SessionState.BOUND, SessionState.CLOSING)


class ReserveOutcome(enum.StrEnum):
    STARTED = "STARTED"  # new version, attempt 1, slot taken
    RETRY_STARTED = "RETRY_STARTED"  # same id+digest after FAILED_CLEAN: new attempt, slot taken
    IN_PROGRESS = "IN_PROGRESS"  # same id+digest still LOADING: same attempt, nothing new
    ALREADY_COMPLETED = "ALREADY_COMPLETED"  # same id+digest already committed: a no-op


@dataclass(frozen=True, slots=True)
class VersionKey:
    deployment_epoch: int
    version_id: str


@dataclass(frozen=True, slots=True)
class ReadyReceipt:
    """An engine's proof that it holds exactly this version for this attempt."""

    engine: str
    version_id: str
    digest: str
    lora_name: str
    attempt: int
    incarnation: str


@dataclass(frozen=True, slots=True)
class Reservation:
    version_id: str
    digest: str
    lora_name: str
    attempt: int
    outcome: ReserveOutcome
    state: VersionState
    engines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CommitReceipt:
    version_id: str
    lora_name: str
    attempt: int
    default_revision: int
    previous_default: str | None


@dataclass(frozen=True, slots=True)
class Binding:
    session_key: str
    version_id: str
    lora_name: str
    digest: str
    default_revision: int


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    session_key: str
    version_id: str | None  # None: the Session never bound
    released_now: bool  # False on a replay: the ref was dropped by an earlier call


@dataclass(frozen=True, slots=True)
class ReclaimClaim:
    version_id: str
    lora_name: str
    reclaim_id: str
    engines: tuple[str, ...]
    confirmed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SessionStatus:
    session_key: str
    state: SessionState
    version_id: str | None
    lease: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """An owner's lease: the Sessions it binds stay held while it is renewed.

    ``released`` lists the Session keys of the owner's previous incarnation that this grant
    released at once (``on_restart="release"``); ``adopted`` those it took over (``"adopt"``).
    ``expires_at`` is on the registry host's clock; a holder should rely on its own clock and
    the ``ttl`` measured from when it *sent* the call (see :class:`~agentic_lora.leases.LeaseKeeper`).
    """

    lease_id: str
    owner: str
    incarnation: str
    ttl: float
    expires_at: float
    released: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LeaseStatus:
    lease_id: str
    owner: str
    incarnation: str
    ttl: float
    expires_at: float
    sessions: int
    names: int


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one expiry sweep did."""

    expired_leases: tuple[str, ...] = ()
    expired_sessions: tuple[str, ...] = ()
    forgotten_names: int = 0


@dataclass(frozen=True, slots=True)
class NamedSession:
    """A client-chosen Session name (the gateway's Session id) and the registry Session behind it.

    ``binding`` is None until the Session's first generation binds it. ``adopted`` is True when
    this call moved the name from another lease (a restarted gateway, or another replica) to the
    caller's.
    """

    name: str
    session_key: str
    lease: str | None
    binding: Binding | None = None
    adopted: bool = False


@dataclass(frozen=True, slots=True)
class VersionStatus:
    """One version as the registry sees it.

    ``ready_engines``: while LOADING, the engines whose READY for this attempt counts; once
    PUBLISHED or RETIRED, the engines that hold the version under their *current* incarnation,
    so the only ones a request for it may be routed to (an engine that restarted drops out until
    the version is loaded onto it again and its READY recorded).
    """

    version_id: str
    digest: str
    lora_name: str
    state: VersionState
    attempt: int
    session_refs: int
    ready_engines: tuple[str, ...] = ()
    cleaned_engines: tuple[str, ...] = ()
    reclaim_id: str | None = None
    reclaimed_engines: tuple[str, ...] = ()
    published_revision: int | None = None


class DispatchView(NamedTuple):
    """What the dispatch guard reads of one version: the :class:`VersionStatus` fields of the
    same names, without building the rest of the status (it is read once per dispatch)."""

    state: VersionState
    lora_name: str
    ready_engines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EngineStatus:
    engine: str
    incarnation: str | None


@dataclass(frozen=True, slots=True)
class RegistryStatus:
    deployment_epoch: int
    capacity: int
    engines: tuple[EngineStatus, ...]
    default_version: str | None
    default_revision: int
    slots_in_use: int
    pending_version: str | None
    versions: tuple[VersionStatus, ...] = field(default_factory=tuple)
    live_sessions: int = 0
    leases: tuple[LeaseStatus, ...] = field(default_factory=tuple)
    named_sessions: int = 0


# --- wire form ----------------------------------------------------------------------------------

_T = TypeVar("_T")


def to_wire(value: Any) -> Any:
    """A JSON-able form of any registry value (dataclasses become dicts tagged with their type)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"__type__": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = to_wire(getattr(value, f.name))
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [to_wire(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_wire(v) for k, v in value.items()}
    return value


_TYPES: dict[str, type[Any]] = {}


def _register(*classes: type[Any]) -> None:
    for c in classes:
        _TYPES[c.__name__] = c


_register(
    ReadyReceipt,
    Reservation,
    CommitReceipt,
    Binding,
    ReleaseResult,
    ReclaimClaim,
    SessionStatus,
    VersionStatus,
    EngineStatus,
    RegistryStatus,
    VersionKey,
    LeaseGrant,
    LeaseStatus,
    SweepResult,
    NamedSession,
)

_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "state": VersionState,
    "outcome": ReserveOutcome,
}


def from_wire(value: Any) -> Any:
    """Inverse of :func:`to_wire`."""
    if isinstance(value, dict) and "__type__" in value:
        cls = _TYPES[value["__type__"]]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in value:
                continue
            raw = from_wire(value[f.name])
            if isinstance(raw, list):
                raw = tuple(raw)
            if f.name == "state" and raw is not None:
                raw = SessionState(raw) if cls is SessionStatus else VersionState(raw)
            elif f.name in _ENUM_FIELDS and raw is not None:
                raw = _ENUM_FIELDS[f.name](raw)
            kwargs[f.name] = raw
        return cls(**kwargs)
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    return value
