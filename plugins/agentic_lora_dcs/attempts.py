"""The sidecar's attempt ledger: which attempt of which name may do what (pure, no I/O).

One record per (lora_name, attempt). The rules the ledger enforces, and the race each prevents:

* A message of an attempt older than the newest one seen for its name is refused
  (``STALE_ATTEMPT``): a late Begin, bucket or End of a superseded attempt never recreates a stash,
  re-arms a collective or loads anything.
* A cleanup that finds no record leaves a ``CLEANED`` record behind (a fence): the Begin it
  overtook is refused when it finally arrives (``FENCED``).
* A cleanup only ever touches its own attempt's record; a stale cleanup never drops a newer
  attempt's stash nor unloads what a newer attempt loaded.
* Each (attempt, bucket index) is armed at most once, so a duplicated bucket message is answered
  from the record and never joins a second collective.
* A newer Begin supersedes an older attempt that only holds a stash; it is refused while an older
  attempt may hold the engine (loading, loaded or unknown), because both load the same name.
* A reclaimed name is fenced for good: nothing of it is ever loaded again through this sidecar.

Every decision happens in one synchronous call on the event loop, so no two messages interleave
inside a decision.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from agentic_lora_dcs.plan import BucketPlan
from agentic_lora_dcs.protocol import BucketState
from agentic_lora_dcs.protocol import CleanupOutcome
from agentic_lora_dcs.protocol import Reason

__all__ = [
    "TRANSITIONS",
    "AttemptIdentity",
    "AttemptRecord",
    "AttemptState",
    "BeginDecision",
    "BucketDecision",
    "CleanupDecision",
    "EndDecision",
    "IllegalTransitionError",
    "Ledger",
    "Refused",
    "engine_part",
]


class AttemptState(enum.StrEnum):
    PREPARED = "PREPARED"  # begin accepted; buckets arriving into the stash
    LOADING = "LOADING"  # end running: verify, materialise, load into the engine
    READY = "READY"  # loaded (pinned) into the engine
    FAILED = "FAILED"  # refused; stash dropped, nothing loaded
    UNCERTAIN = "UNCERTAIN"  # the engine may hold the name; only a cleanup resolves it
    CLEANED = "CLEANED"  # cleaned up, or fenced before its begin arrived
    RECLAIMED = "RECLAIMED"  # unloaded for good by a reclaim

    @property
    def may_hold_engine(self) -> bool:
        """The engine holds, or may hold, this attempt's adapter."""
        return self in (AttemptState.LOADING, AttemptState.READY, AttemptState.UNCERTAIN)


TRANSITIONS: Mapping[AttemptState, frozenset[AttemptState]] = {
    AttemptState.PREPARED: frozenset(
        {AttemptState.LOADING, AttemptState.FAILED, AttemptState.CLEANED}
    ),
    AttemptState.LOADING: frozenset(
        {AttemptState.READY, AttemptState.FAILED, AttemptState.UNCERTAIN}
    ),
    AttemptState.READY: frozenset({AttemptState.CLEANED, AttemptState.RECLAIMED}),
    AttemptState.FAILED: frozenset({AttemptState.CLEANED}),
    AttemptState.UNCERTAIN: frozenset(
        {AttemptState.READY, AttemptState.CLEANED, AttemptState.RECLAIMED}
    ),
    AttemptState.CLEANED: frozenset(),
    AttemptState.RECLAIMED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A bug: a transition the table does not allow."""


class Refused(Exception):
    """A message the sidecar will not act on; ``clean`` says whether the attempt holds nothing."""

    def __init__(self, reason: Reason, message: str, *, clean: bool, **details: Any) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.clean = clean
        self.details: dict[str, Any] = details


@dataclass(frozen=True, slots=True)
class AttemptIdentity:
    """What a Begin fixes; a duplicate Begin must repeat it exactly."""

    version_id: str
    digest: str
    backend: str
    config_json: str
    plan: BucketPlan
    incarnation: str  # sidecar id / engine fingerprint the driver read before Begin
    driver: str  # the publisher-side driver that owns the transfer

    def same_content(self, other: AttemptIdentity) -> bool:
        """Same version, content, plan and transport (drivers and incarnations may differ)."""
        return (self.version_id, self.digest, self.backend, self.config_json, self.plan) == (
            other.version_id,
            other.digest,
            other.backend,
            other.config_json,
            other.plan,
        )

    @property
    def engine_incarnation(self) -> str:
        return engine_part(self.incarnation)


def engine_part(incarnation: str) -> str:
    """The engine fingerprint inside a ``<sidecar id>/<engine fingerprint>`` incarnation."""
    return incarnation.partition("/")[2]


@dataclass(slots=True)
class AttemptRecord:
    """The ledger's view of one attempt (resources live in the receiver, keyed the same way)."""

    lora_name: str
    attempt: int
    state: AttemptState
    identity: AttemptIdentity | None  # None for a fence (cleanup before begin)
    armed: int = 0  # buckets whose collective was started (each exactly once)
    received: int = 0  # buckets whose bytes arrived and matched their checksums
    failure: Reason | None = None
    drivers: set[str] = field(default_factory=set)  # every driver that ever began it

    @property
    def buckets(self) -> int:
        return 0 if self.identity is None else len(self.identity.plan.buckets)

    def move_to(self, new: AttemptState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransitionError(
                f"{self.lora_name} attempt {self.attempt}: {self.state} -> {new} is not allowed"
            )
        self.state = new


class BeginDecision(enum.Enum):
    NEW = "NEW"  # a fresh record: join the group and receive the plan
    DUPLICATE = "DUPLICATE"  # the same driver's Begin again: answer from the record
    RESUME = "RESUME"  # a new driver for an attempt past its transfer: go straight to End


class BucketDecision(enum.Enum):
    ARM = "ARM"  # join the collective for this key now (the only way a collective starts)
    DUPLICATE = "DUPLICATE"  # already armed: answer from the record


class EndDecision(enum.Enum):
    START = "START"  # run verify / materialise / load
    JOIN = "JOIN"  # an End is already running: await its outcome
    DONE = "DONE"  # already READY: answer the same receipt
    RECHECK = "RECHECK"  # UNCERTAIN: ask the engine whether the load landed


@dataclass(frozen=True, slots=True)
class CleanupDecision:
    outcome: CleanupOutcome
    record: AttemptRecord
    previous: AttemptState | None  # state before the cleanup (None: a fence was created)
    superseded: tuple[AttemptRecord, ...] = ()  # older stash-only attempts a new fence retired


@dataclass(slots=True)
class _Name:
    attempts: dict[int, AttemptRecord] = field(default_factory=dict)
    reclaim_id: str | None = None

    @property
    def newest(self) -> int:
        return max(self.attempts, default=0)


# States a newer Begin may retire: nothing of them is held by the engine.
_RETIRABLE = (AttemptState.PREPARED, AttemptState.FAILED)


def _holds(record: AttemptRecord, live_engine: str) -> bool:
    """The engine, in its current incarnation, holds or may hold this attempt's adapter."""
    if not record.state.may_hold_engine or record.identity is None:
        return False
    return record.state is AttemptState.LOADING or record.identity.engine_incarnation == live_engine


def _failed(record: AttemptRecord) -> Refused:
    # Every later message of a failed attempt gets the root cause, whichever arrives first.
    return Refused(
        record.failure or Reason.ATTEMPT_FAILED,
        f"attempt {record.attempt} of {record.lora_name} failed earlier",
        clean=True,
        failed_earlier=True,
    )


class Ledger:
    """Every attempt record of this sidecar incarnation, and the decisions over them."""

    def __init__(self) -> None:
        self._names: dict[str, _Name] = {}

    def __iter__(self) -> Iterator[AttemptRecord]:
        for entry in self._names.values():
            yield from entry.attempts.values()

    def get(self, lora_name: str, attempt: int) -> AttemptRecord | None:
        entry = self._names.get(lora_name)
        return None if entry is None else entry.attempts.get(attempt)

    def reclaimed_names(self) -> tuple[str, ...]:
        return tuple(n for n, e in self._names.items() if e.reclaim_id is not None)

    def reclaim_id(self, lora_name: str) -> str | None:
        entry = self._names.get(lora_name)
        return None if entry is None else entry.reclaim_id

    # --- decisions -------------------------------------------------------------------------------

    def begin(
        self, lora_name: str, attempt: int, identity: AttemptIdentity
    ) -> tuple[BeginDecision, AttemptRecord, list[AttemptRecord]]:
        """Accept, repeat, resume or refuse a Begin; also returns the records it retired.

        ``identity.incarnation`` is the sidecar's current one (the receiver checked it), so a
        record whose engine part differs describes a dead engine process that holds nothing.
        """
        entry = self._names.setdefault(lora_name, _Name())
        if entry.reclaim_id is not None:
            raise Refused(Reason.RECLAIMED, f"{lora_name} was reclaimed", clean=True)
        existing = entry.attempts.get(attempt)
        if existing is not None:
            return self._begin_again(entry, existing, identity)
        if attempt < entry.newest:
            raise Refused(
                Reason.STALE_ATTEMPT,
                f"attempt {attempt} of {lora_name} is older than attempt {entry.newest}",
                clean=True,
                newest=entry.newest,
            )
        live = identity.engine_incarnation
        holders = [r for r in entry.attempts.values() if _holds(r, live)]
        if holders:
            raise Refused(
                Reason.ATTEMPT_ACTIVE,
                f"attempt {holders[0].attempt} of {lora_name} still holds the engine",
                clean=True,
                active_attempt=holders[0].attempt,
            )
        retired = [r for r in entry.attempts.values() if r.state in _RETIRABLE]
        for old in retired:
            old.move_to(AttemptState.CLEANED)
        record = AttemptRecord(lora_name, attempt, AttemptState.PREPARED, identity)
        record.drivers.add(identity.driver)
        entry.attempts[attempt] = record
        return BeginDecision.NEW, record, retired

    def _begin_again(
        self, entry: _Name, existing: AttemptRecord, identity: AttemptIdentity
    ) -> tuple[BeginDecision, AttemptRecord, list[AttemptRecord]]:
        name, attempt = existing.lora_name, existing.attempt
        if existing.state is AttemptState.CLEANED:
            raise Refused(Reason.FENCED, f"attempt {attempt} of {name} was cleaned up", clean=True)
        assert existing.identity is not None  # only fences have none, and fences are CLEANED
        if not existing.identity.same_content(identity):
            # Not clean: the attempt that owns this key keeps whatever it holds.
            raise Refused(
                Reason.ATTEMPT_CONFLICT,
                f"attempt {attempt} of {name} was begun with another identity or plan",
                clean=False,
            )
        if identity.driver == existing.identity.driver:
            if existing.state is AttemptState.FAILED:
                raise _failed(existing)
            return BeginDecision.DUPLICATE, existing, []
        if identity.driver in existing.drivers:
            raise Refused(
                Reason.STALE_DRIVER,
                f"the driver of this Begin was superseded for attempt {attempt} of {name}",
                clean=not existing.state.may_hold_engine,
            )
        # A new driver takes the attempt over (the publisher retried it).
        existing.drivers.add(identity.driver)
        engine_gone = existing.identity.engine_incarnation != identity.engine_incarnation
        if existing.state is AttemptState.LOADING:
            return BeginDecision.RESUME, existing, []
        if existing.state in (AttemptState.READY, AttemptState.UNCERTAIN) and not engine_gone:
            return BeginDecision.RESUME, existing, []
        # Stash only, failed cleanly, or loaded into an engine process that is gone: nothing of
        # it is held, so the attempt starts over under a fresh record (and a fresh group).
        existing.move_to(AttemptState.CLEANED)
        record = AttemptRecord(name, attempt, AttemptState.PREPARED, identity)
        record.drivers = existing.drivers
        entry.attempts[attempt] = record
        return BeginDecision.NEW, record, [existing]

    def _current(self, lora_name: str, attempt: int) -> AttemptRecord:
        entry = self._names.get(lora_name)
        record = None if entry is None else entry.attempts.get(attempt)
        if entry is not None and entry.reclaim_id is not None:
            raise Refused(Reason.RECLAIMED, f"{lora_name} was reclaimed", clean=True)
        if record is None:
            newest = 0 if entry is None else entry.newest
            if attempt < newest:
                raise Refused(
                    Reason.STALE_ATTEMPT,
                    f"attempt {attempt} of {lora_name} is older than attempt {newest}",
                    clean=True,
                    newest=newest,
                )
            raise Refused(
                Reason.UNKNOWN_ATTEMPT, f"no begin for attempt {attempt} of {lora_name}", clean=True
            )
        if record.state is AttemptState.CLEANED:
            raise Refused(
                Reason.FENCED, f"attempt {attempt} of {lora_name} was cleaned up", clean=True
            )
        if record.state is AttemptState.FAILED:
            raise _failed(record)
        if record.attempt < self._names[lora_name].newest:
            raise Refused(
                Reason.STALE_ATTEMPT,
                f"attempt {attempt} of {lora_name} was superseded",
                clean=not record.state.may_hold_engine,
            )
        return record

    def bucket(
        self, lora_name: str, attempt: int, index: int
    ) -> tuple[BucketDecision, AttemptRecord, BucketState]:
        """Arm the collective for (attempt, index) at most once; duplicates answer from the record."""
        record = self._current(lora_name, attempt)
        if index >= record.buckets:
            raise Refused(
                Reason.BAD_BUCKET,
                f"bucket {index} is outside the plan of {record.buckets} buckets",
                clean=not record.state.may_hold_engine,
            )
        if index < record.armed:
            state = BucketState.RECEIVED if index < record.received else BucketState.ARMED
            return BucketDecision.DUPLICATE, record, state
        if record.state is not AttemptState.PREPARED:
            raise Refused(
                Reason.OUT_OF_ORDER,
                f"bucket {index} after attempt {attempt} ended",
                clean=not record.state.may_hold_engine,
                index=index,
            )
        if index > record.armed:
            raise Refused(
                Reason.OUT_OF_ORDER,
                f"bucket {index} before bucket {record.armed}",
                clean=True,
                expected=record.armed,
            )
        record.armed += 1
        return BucketDecision.ARM, record, BucketState.ARMED

    def end(self, lora_name: str, attempt: int) -> tuple[EndDecision, AttemptRecord]:
        record = self._current(lora_name, attempt)
        if record.state is AttemptState.READY:
            return EndDecision.DONE, record
        if record.state is AttemptState.LOADING:
            return EndDecision.JOIN, record
        if record.state is AttemptState.UNCERTAIN:
            return EndDecision.RECHECK, record
        if record.armed < record.buckets:
            raise Refused(
                Reason.INCOMPLETE,
                f"end after {record.armed} of {record.buckets} buckets",
                clean=True,
                armed=record.armed,
                buckets=record.buckets,
            )
        record.move_to(AttemptState.LOADING)
        return EndDecision.START, record

    def cleanup(self, lora_name: str, attempt: int) -> CleanupDecision:
        """Clean exactly this attempt; with no record, leave a fence that refuses its late Begin."""
        entry = self._names.setdefault(lora_name, _Name())
        record = entry.attempts.get(attempt)
        if record is None:
            superseded: list[AttemptRecord] = []
            if attempt > entry.newest:
                # The publisher moved past every older attempt; one still only stashing is dead.
                superseded = [
                    r for r in entry.attempts.values() if r.state is AttemptState.PREPARED
                ]
                for old in superseded:
                    old.move_to(AttemptState.CLEANED)
            fence = AttemptRecord(lora_name, attempt, AttemptState.CLEANED, None)
            entry.attempts[attempt] = fence
            return CleanupDecision(CleanupOutcome.FENCED, fence, None, tuple(superseded))
        previous = record.state
        if previous in (AttemptState.CLEANED, AttemptState.RECLAIMED):
            return CleanupDecision(CleanupOutcome.ALREADY_CLEAN, record, previous)
        if previous is AttemptState.LOADING:
            # The caller awaits the running End first; LOADING is never cleaned directly.
            raise IllegalTransitionError("cleanup of a LOADING attempt before its End settled")
        record.move_to(AttemptState.CLEANED)
        outcome = (
            CleanupOutcome.ALREADY_CLEAN
            if previous is AttemptState.FAILED
            else CleanupOutcome.CLEANED
        )
        return CleanupDecision(outcome, record, previous)

    def holders(self, lora_name: str) -> list[AttemptRecord]:
        """Attempts whose adapter the engine holds or may hold under ``lora_name``."""
        entry = self._names.get(lora_name)
        if entry is None:
            return []
        return [r for r in entry.attempts.values() if r.state.may_hold_engine]

    def mark_reclaimed(self, lora_name: str, reclaim_id: str) -> None:
        """Fence the name for good: every attempt of it ends (RECLAIMED, or CLEANED if unloaded)."""
        entry = self._names.setdefault(lora_name, _Name())
        for record in entry.attempts.values():
            if record.state in (AttemptState.READY, AttemptState.UNCERTAIN):
                record.move_to(AttemptState.RECLAIMED)
            elif record.state in (AttemptState.PREPARED, AttemptState.FAILED):
                record.move_to(AttemptState.CLEANED)
        entry.reclaim_id = reclaim_id
