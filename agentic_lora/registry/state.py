"""The registry's in-memory state and the lookups every rule of the core shares.

:class:`RegistryState` holds everything the registry knows: the fleet, the versions, the default,
Sessions, owner leases, durable names, engine incarnations, the registry clock and the idempotency
window. :class:`~agentic_lora.registry.core.RegistryCore` is a ``RegistryState`` with the verbs;
the rule modules beside it (:mod:`~agentic_lora.registry.session_lifecycle`,
:mod:`~agentic_lora.registry.owner_leases`, :mod:`~agentic_lora.registry.durable_names`,
:mod:`~agentic_lora.registry.engine_incarnations`, :mod:`~agentic_lora.registry.views`,
:mod:`~agentic_lora.registry.snapshot`) are functions over it, each run inside one of the core's
atomic steps.
Like the core, nothing here does I/O, reads a clock or draws randomness, so a journal replays it
exactly. The records are mutable bookkeeping only the registry's own modules touch; everything
handed out is a frozen value of :mod:`~agentic_lora.registry.types`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from agentic_lora.errors import CapacityError
from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import LeaseExpiredError
from agentic_lora.errors import NotReadyError
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import RevisionConflictError
from agentic_lora.errors import StaleAttemptError
from agentic_lora.errors import UnknownEngineError
from agentic_lora.errors import UnknownVersionError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.identity import is_plain_token
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.registry.idempotency import IdempotencyWindow
from agentic_lora.registry.transitions import VersionEvent
from agentic_lora.registry.transitions import advance
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import CarriesRef
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import VersionState

__all__ = [
    "LeaseRecord",
    "NameRecord",
    "RegistryState",
    "SessionRecord",
    "VersionRecord",
    "check_time",
    "check_token",
    "lease_id",
]

_MAX_NAME = 256


class VersionRecord(CarriesRef):
    """Mutable bookkeeping of one version; only the registry's own modules touch it.

    Its identity is one :class:`~agentic_lora.foundation.identity.VersionRef` (``ref``), replaced
    whole when a retry starts a new attempt; ``version_id``, ``digest``, ``lora_name`` and
    ``attempt`` read it. Every receipt the registry hands out takes ``ref`` as it is, so none can
    pair this attempt's number with another attempt's parts.
    """

    __slots__ = (
        "cleaned",
        "commit_receipt",
        "ready",
        "reclaim_id",
        "reclaimed",
        "ref",
        "reloads",
        "session_refs",
        "state",
    )

    def __init__(self, ref: VersionRef) -> None:
        self.ref = ref
        self.state = VersionState.LOADING
        self.ready: dict[str, ReadyReceipt] = {}
        self.cleaned: set[str] = set()
        self.reclaim_id: str | None = None
        self.reclaimed: set[str] = set()
        self.session_refs = 0
        self.commit_receipt: CommitReceipt | None = None
        #: How often a rollback loaded it again after a reclaim (each reclaim gets its own id).
        self.reloads = 0

    @property
    def committed_before(self) -> bool:
        """Whether some attempt of it was ever the default (then it can be rolled back to, and
        an attempt of it that is LOADING is a rollback's reload, never a first publication)."""
        return self.commit_receipt is not None


class SessionRecord:
    __slots__ = ("binding", "lease", "state")

    def __init__(
        self, state: SessionState, binding: Binding | None, lease: str | None = None
    ) -> None:
        self.state = state
        self.binding = binding
        self.lease = lease


class LeaseRecord:
    """One owner incarnation's lease and what hangs on it."""

    __slots__ = ("expires_at", "incarnation", "lease_id", "names", "owner", "sessions", "ttl")

    def __init__(self, owner: str, incarnation: str, ttl: float, expires_at: float) -> None:
        self.lease_id = lease_id(owner, incarnation)
        self.owner = owner
        self.incarnation = incarnation
        self.ttl = ttl
        self.expires_at = expires_at
        self.sessions: set[str] = set()
        self.names: set[str] = set()


class NameRecord:
    """A client-chosen Session name; ``closed_at`` set makes it a tombstone (kept by age)."""

    __slots__ = ("closed_at", "lease", "session_key", "why")

    def __init__(self, session_key: str, lease: str | None) -> None:
        self.session_key = session_key
        self.lease = lease
        self.closed_at: float | None = None
        self.why: str | None = None


def lease_id(owner: str, incarnation: str) -> str:
    return f"{owner}/{incarnation}"


def check_token(value: object, what: str) -> str:
    if not is_plain_token(value, _MAX_NAME):
        raise InvalidStateError(
            f"{what} must be a printable string of 1-{_MAX_NAME} characters without whitespace",
            reason=f"bad_{what}",
        )
    return value


def check_time(value: object, what: str, *, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        raise InvalidStateError(
            f"{what} must be a finite number{' above 0' if positive else ''}", reason=f"bad_{what}"
        )
    return float(value)


class RegistryState:
    """The registry's state and shared lookups (see module docstring).

    ``capacity`` counts versions that hold an engine slot: LOADING, PUBLISHED, RETIRED,
    RECLAIMING, and ABORTED until every engine confirmed its cleanup.
    """

    def __init__(
        self,
        *,
        engines: Sequence[str],
        capacity: int,
        deployment_epoch: int = 0,
        prefix: str = "policy_lora",
        idempotency_window: int = 16384,
    ) -> None:
        if not engines:
            raise ValueError("the fleet needs at least one engine")
        if len(set(engines)) != len(engines):
            raise ValueError(f"duplicate engine names in {list(engines)}")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.engines: tuple[str, ...] = tuple(engines)
        self.capacity = capacity
        self.deployment_epoch = deployment_epoch
        self.prefix = prefix
        make_lora_name(prefix, deployment_epoch, "probe", "0" * 64)  # validates the prefix early
        self._versions: dict[str, VersionRecord] = {}
        self._sessions: dict[str, SessionRecord] = {}
        #: The default version (None before the first commit), and how many commits moved it.
        self.default_version: str | None = None
        self.default_revision = 0
        #: While the default is one a rollback made the default again: the version it replaced.
        self.rolled_back_from: str | None = None
        self._pending: str | None = None
        self._incarnations: dict[str, str | None] = dict.fromkeys(self.engines)
        #: Each engine's membership (see membership); the configured fleet starts ACTIVE.
        self._members: dict[str, MemberState] = dict.fromkeys(self.engines, MemberState.ACTIVE)
        self._leases: dict[str, LeaseRecord] = {}  # live leases by id
        self._owners: dict[str, str] = {}  # owner -> its current lease id
        self._dead_leases: OrderedDict[str, str] = OrderedDict()  # lease id -> why it ended
        self._names: dict[str, NameRecord] = {}
        self._name_of: dict[str, str] = {}  # session key -> name
        #: The latest ``now`` any timed verb brought: the time of untimed transitions (a close
        #: tombstones a name at this time). Never goes backwards.
        self.now = 0.0
        self._done = IdempotencyWindow(idempotency_window)
        #: Number of state-changing calls applied so far (the journal's sequence number).
        self.seq = 0

    def _version(self, version_id: str) -> VersionRecord:
        v = self._versions.get(version_id)
        if v is None:
            raise UnknownVersionError(f"no version {version_id!r}", version=version_id)
        return v

    def _engine(self, engine: str) -> None:
        if engine not in self._incarnations:
            raise UnknownEngineError(
                f"engine {engine!r} is not in the fleet {list(self.engines)}", engine=engine
            )

    def active_members(self) -> tuple[str, ...]:
        """The ACTIVE members in fleet order: the routable engines, the ones readiness counts."""
        return tuple(e for e in self.engines if self._members[e] is MemberState.ACTIVE)

    def _slots_in_use(self) -> int:
        return sum(1 for v in self._versions.values() if v.state.holds_slot)

    def _admit(self, version_id: str) -> None:
        if self._pending is not None:
            raise PublicationBlockedError(
                f"publication of {self._pending!r} is still pending; one at a time",
                version=version_id,
                pending=self._pending,
            )
        in_use = self._slots_in_use()
        if in_use >= self.capacity:
            raise CapacityError(
                f"all {self.capacity} version slots are held; reclaim a retired version first",
                version=version_id,
                capacity=self.capacity,
                held=[v.version_id for v in self._versions.values() if v.state.holds_slot],
            )

    def _attempt(self, v: VersionRecord, attempt: int) -> None:
        if attempt != v.attempt:
            raise StaleAttemptError(
                f"attempt {attempt} of {v.version_id!r} is superseded by attempt {v.attempt}",
                version=v.version_id,
                attempt=attempt,
                current_attempt=v.attempt,
            )

    def _live_lease(self, lease_id: str) -> LeaseRecord:
        lease = self._leases.get(lease_id)
        if lease is None:
            why = self._dead_leases.get(lease_id, "unknown")
            raise LeaseExpiredError(
                f"lease {lease_id!r} is not live ({why})", lease=lease_id, reason=why
            )
        return lease

    def _tick(self, now: float) -> None:
        # Called only once the verb can no longer be refused: a refused call is not journaled, so
        # if it moved the clock, a replay would tombstone names at another time than the live run.
        self.now = max(self.now, now)

    def _require_ready(self, v: VersionRecord, attempt: int) -> None:
        """Refuse (NOT_READY) unless every ACTIVE member holds ``v``'s current attempt under its
        current incarnation: the one readiness rule of every move of the default (commit,
        rollback). With no ACTIVE member at all, nothing is ready."""
        active = self.active_members()
        missing = [
            e
            for e in active
            if (r := v.ready.get(e)) is None or r.incarnation != self._incarnations[e]
        ]
        if missing or not active:
            raise NotReadyError(
                f"{v.version_id!r} attempt {attempt} lacks READY from {missing}",
                version=v.version_id,
                attempt=attempt,
                missing=missing,
            )

    def _move_default(
        self, v: VersionRecord, attempt: int, expected_default_revision: int, event: VersionEvent
    ) -> CommitReceipt:
        """The one move of the default (``event``: a commit, or a rollback of a RETIRED version):
        refused unless ``attempt`` is ``v``'s current one, the default revision is the expected
        one and every engine holds ``v``; then ``v`` becomes the default (see _make_default)."""
        self._attempt(v, attempt)
        if expected_default_revision != self.default_revision:
            raise RevisionConflictError(
                f"default revision is {self.default_revision}, not {expected_default_revision}",
                version=v.version_id,
                default_revision=self.default_revision,
            )
        self._require_ready(v, attempt)
        return self._make_default(v, event)

    def _make_default(self, v: VersionRecord, event: VersionEvent) -> CommitReceipt:
        """``v`` becomes the default (by ``event``: a commit, or a rollback of a RETIRED
        version); the previous default is superseded. A version committed before comes back by
        a rollback, whichever event moved it, and the receipt and the status say so."""
        rollback = v.committed_before
        previous = self.default_version
        new_state = advance(v.version_id, v.state, event)
        if previous is not None:
            old = self._versions[previous]
            old.state = advance(previous, old.state, VersionEvent.SUPERSEDE)
        v.state = new_state
        self.default_version = v.version_id
        self.default_revision += 1
        self.rolled_back_from = previous if rollback else None
        self._pending = None
        v.commit_receipt = CommitReceipt(
            ref=v.ref,
            default_revision=self.default_revision,
            previous_default=previous,
            rollback=rollback,
        )
        return v.commit_receipt

    def _cleaned(self, v: VersionRecord, engine: str) -> None:
        v.cleaned.add(engine)
        self._settle(v)

    def _settle(self, v: VersionRecord) -> None:
        """Complete ``v``'s cleanup or reclaim once every engine of the fleet confirmed it (after
        a confirmation, or after an engine that had not confirmed left the fleet)."""
        if v.state is VersionState.RECLAIMING and v.reclaimed.issuperset(self.engines):
            v.state = advance(v.version_id, v.state, VersionEvent.ALL_RECLAIMED)
        elif v.state is VersionState.ABORTED and v.cleaned.issuperset(self.engines):
            # Only now is it proven that no engine holds the candidate: free the slot. An aborted
            # reload of a version committed before is RECLAIMED again (what it was), never
            # FAILED_CLEAN: publishing its id again must stay a no-op.
            event = VersionEvent.RELOAD_CLEANED if v.committed_before else VersionEvent.ALL_CLEANED
            v.state = advance(v.version_id, v.state, event)
            if event is VersionEvent.RELOAD_CLEANED:
                # RECLAIMED again, and the cleanup was that reclaim: every engine confirmed it
                # holds nothing of the attempt. A reclaimer's claim of it (raced with the reload,
                # or after a restart) must get a settled claim back, not one without an id.
                v.reclaim_id = self.reclaim_id_of(v)
                v.reclaimed = set(self.engines)
            if self._pending == v.version_id:
                self._pending = None

    def reclaim_id_of(self, v: VersionRecord) -> str:
        """The id ``v``'s current load is reclaimed under: stable per reclaim, and new for a
        version a rollback loaded again (a backend confirms a reclaim once per id, and must
        unload it once more)."""
        return f"reclaim-{self.deployment_epoch}-{v.version_id}" + (
            f".{v.reloads}" if v.reloads else ""
        )

    def _reclaimed(self, v: VersionRecord, engine: str) -> None:
        v.reclaimed.add(engine)
        if v.state is not VersionState.RECLAIMING and v.reclaimed.issuperset(self.engines):
            advance(v.version_id, v.state, VersionEvent.ALL_RECLAIMED)  # raises InvalidStateError
        self._settle(v)
