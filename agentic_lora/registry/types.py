"""Values the registry takes and returns: states, receipts, bindings, status.

All are frozen (immutable) so a result handed to one caller can be handed to a replaying caller
as-is; ``to_wire``/``from_wire`` give the JSON form used by the journal and the Ray client.

The receipts (:class:`ReadyReceipt`, :class:`Reservation`, :class:`CommitReceipt`,
:class:`Binding`, :class:`ReclaimClaim`) carry the version they name as one
:class:`~agentic_lora.foundation.identity.VersionRef` (``ref``), never as loose fields; their
``version_id``, ``digest``, ``lora_name`` and ``attempt`` are read-only views of it.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from operator import attrgetter
from typing import TYPE_CHECKING
from typing import Any
from typing import Generic
from typing import NamedTuple
from typing import Self
from typing import TypeVar
from typing import overload

from agentic_lora.foundation.identity import VersionRef

__all__ = [
    "Binding",
    "CarriesRef",
    "CommitReceipt",
    "DispatchView",
    "EngineStatus",
    "LeaseGrant",
    "LeaseStatus",
    "LeaseTerms",
    "MemberState",
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


class MemberState(enum.StrEnum):
    """An engine's membership of the fleet (see :mod:`~agentic_lora.registry.membership`).

    Only ACTIVE members are routable for new work and count for readiness (the default moves only
    when every ACTIVE member is READY). A JOINING engine is loading what is dispatchable; a
    DRAINING one finishes its in-flight requests and takes nothing new; an EJECTED one failed its
    health probes and waits for a repair. REMOVED is terminal: the engine left the fleet.
    """

    JOINING = "JOINING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    EJECTED = "EJECTED"
    REMOVED = "REMOVED"


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
    RELOAD_STARTED = "RELOAD_STARTED"  # a rollback to a RECLAIMED version: next attempt, slot taken


@dataclass(frozen=True, slots=True)
class VersionKey:
    deployment_epoch: int
    version_id: str


_P = TypeVar("_P")


class _RefPart(property, Generic[_P]):
    """A read-only view of one field of the owner's ``ref``, typed ``_P``.

    A ``property`` around a C-level ``attrgetter``, so no Python frame runs per read: these views
    are read about five times per dispatch, and a read costs what a ``def`` property's does
    (``bench/ref_views.py``). Only the type checker sees the overloads below.
    """

    def __init__(self, field_name: str) -> None:
        super().__init__(attrgetter(f"ref.{field_name}"))

    if TYPE_CHECKING:

        @overload
        def __get__(self, instance: None, owner: type[Any] | None = None, /) -> Self: ...
        @overload
        def __get__(self, instance: object, owner: type[Any] | None = None, /) -> _P: ...
        def __get__(self, instance: object, owner: type[Any] | None = None, /) -> Self | _P: ...


class CarriesRef:
    """Read-only views of a value's :class:`~agentic_lora.foundation.identity.VersionRef`.

    So ``receipt.version_id`` (``digest``, ``lora_name``, ``attempt``) reads as it always did,
    while the four can only be set together, as ``ref``.
    """

    __slots__ = ()
    ref: VersionRef

    version_id = _RefPart[str]("version_id")
    digest = _RefPart[str]("digest")
    lora_name = _RefPart[str]("lora_name")
    attempt = _RefPart[int]("attempt")


@dataclass(frozen=True, slots=True)
class ReadyReceipt(CarriesRef):
    """An engine's proof that it holds exactly ``ref`` (this version, this attempt).

    ``incarnation`` is the engine process that holds it, read before the load: a receipt from a
    process that restarted since does not count.
    """

    engine: str
    ref: VersionRef
    incarnation: str


@dataclass(frozen=True, slots=True)
class Reservation(CarriesRef):
    """What ``reserve`` answers: the attempt to load (``ref``) and on which ``engines``."""

    ref: VersionRef
    outcome: ReserveOutcome
    state: VersionState
    engines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CommitReceipt(CarriesRef):
    """What ``commit`` answers: ``ref`` (the attempt that committed) is now the default.

    It carries the full ref, digest included (the registry knows it at commit): the receipt
    names the content it made the default, not only the name that content is served under.
    """

    ref: VersionRef
    default_revision: int
    previous_default: str | None
    #: True when this commit was a rollback: ``ref`` was committed before, and
    #: ``previous_default`` is the version it replaced (the rollback's origin).
    rollback: bool = False


@dataclass(frozen=True, slots=True)
class Binding(CarriesRef):
    """A Session's one binding: the version (``ref``) that serves its whole life.

    It carries the full ref, attempt included: a Session only binds a committed version, whose
    attempt is final, so the ref names exactly the adapter the Session's requests are sent to.
    """

    session_key: str
    ref: VersionRef
    default_revision: int
    #: Set when the default this Session bound was made the default by a rollback: the version
    #: that rollback replaced (so a Session can tell it runs a rolled-back version).
    rolled_back_from: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    session_key: str
    version_id: str | None  # None: the Session never bound
    released_now: bool  # False on a replay: the ref was dropped by an earlier call


@dataclass(frozen=True, slots=True)
class ReclaimClaim(CarriesRef):
    """What ``claim_reclaim`` answers: ``ref`` (the attempt that committed, the adapter the
    engines hold) is RECLAIMING under ``reclaim_id``; ``confirmed`` engines already unloaded it."""

    ref: VersionRef
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
class LeaseTerms:
    """An owner's lease as the registry holds it: ``lease_id`` (``owner/incarnation``), its
    ``ttl`` and its deadline ``expires_at``, on the registry host's clock."""

    lease_id: str
    owner: str
    incarnation: str
    ttl: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class LeaseGrant(LeaseTerms):
    """An owner's lease: the Sessions it binds stay held while it is renewed.

    ``released`` lists the Session keys of the owner's previous incarnation that this grant
    released at once (``on_restart="release"``); ``adopted`` those it took over (``"adopt"``).
    ``expires_at`` is on the registry host's clock; a holder should rely on its own clock and
    the ``ttl`` measured from when it *sent* the call (see :class:`~agentic_lora.leases.LeaseKeeper`).
    """

    released: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LeaseStatus(LeaseTerms):
    """A live lease in :class:`RegistryStatus`: its terms and how many Sessions and names it
    holds."""

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
    the version is loaded onto it again and its READY recorded). Only ACTIVE members are
    listed: a JOINING, DRAINING or EJECTED engine is routed nothing, whatever it holds.
    ``held_engines``: every member with a READY recorded for it, whatever its membership (what a
    repair need not load again).
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
    held_engines: tuple[str, ...] = ()

    @property
    def ref(self) -> VersionRef:
        """The version's current attempt as one value (what a READY for it must carry)."""
        return VersionRef(self.version_id, self.digest, self.lora_name, self.attempt)


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
    membership: MemberState = MemberState.ACTIVE


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
    #: Set while the default is one a rollback made the default again: the version it replaced
    #: (the rollback's origin). None once a publication commits a new default.
    rolled_back_from: str | None = None


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
    VersionRef,
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
    "membership": MemberState,
}


#: Looks up the registry's ref of a version by id (see :func:`from_wire`).
RefLookup = Callable[[str], VersionRef]

_REF_KEYS = ("version_id", "digest", "lora_name", "attempt")


def from_wire(value: Any, known: RefLookup | None = None) -> Any:
    """Inverse of :func:`to_wire`.

    Also reads receipts written before they carried a ``ref`` (their identity fields flat, as
    journals and snapshots of earlier releases hold them; see :func:`_flat_ref` for ``known``).
    """
    if isinstance(value, dict) and "__type__" in value:
        cls = _TYPES[value["__type__"]]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in value:
                continue
            raw = from_wire(value[f.name], known)
            if isinstance(raw, list):
                raw = tuple(raw)
            if f.name == "state" and raw is not None:
                raw = SessionState(raw) if cls is SessionStatus else VersionState(raw)
            elif f.name in _ENUM_FIELDS and raw is not None:
                raw = _ENUM_FIELDS[f.name](raw)
            kwargs[f.name] = raw
        if issubclass(cls, CarriesRef) and "ref" not in value:
            kwargs["ref"] = _flat_ref(value, known)
        if cls is VersionStatus and "held_engines" not in value:
            # Written before membership: every engine was ACTIVE, so its holders were these.
            kwargs["held_engines"] = kwargs.get("ready_engines", ())
        return cls(**kwargs)
    if isinstance(value, list):
        return [from_wire(v, known) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v, known) for k, v in value.items()}
    return value


def _flat_ref(value: Mapping[str, Any], known: RefLookup | None) -> VersionRef:
    """The ref of a receipt written with its identity fields flat (before receipts had a ref).

    A flat ``CommitReceipt`` had no digest and a flat ``Binding`` no attempt; ``known`` (the
    registry's own record of the version, while a snapshot loads) gives them. That is exact: a
    version's digest never changes, and a commit or a bind only ever names the attempt that
    committed, which is final. The parts the receipt does carry must agree with the record.
    """
    parts = {k: value[k] for k in _REF_KEYS if k in value}
    if len(parts) == len(_REF_KEYS):
        return VersionRef(**parts)
    if known is None or "version_id" not in parts:
        missing = sorted(set(_REF_KEYS) - set(parts))
        raise ValueError(f"{value.get('__type__')} without a ref lacks {missing}")
    ref = known(parts["version_id"])
    if any(getattr(ref, k) != v for k, v in parts.items()):
        raise ValueError(f"{value.get('__type__')} {parts} disagrees with the registry's {ref}")
    return ref
