"""The registry's state machine: pure, synchronous, deterministic, I/O free.

:class:`RegistryCore` is the single writer's brain. Each public verb is one atomic step: it reads
and changes in-memory state and returns a result or raises a typed error, with no awaits, no clock
and no randomness inside. That gives three properties the rest of the system leans on:

* **Linearisability**: ``bind_first`` reads the default and takes the Session ref in the same step
  as any ``commit`` either before or after it, so "bind before commit -> A, bind after -> B" is
  exact, with no window in which a Session can see B before every engine has it.
* **Replay**: running the same verbs in the same order always gives the same state (minted ids are
  counters, not uuids), so a journal of accepted verbs rebuilds the registry after a restart.
* **Idempotency**: :meth:`RegistryCore.execute` remembers the result of every state-changing call
  by its caller-minted ``request_id``; a replay (the reply was lost) gets the original result back
  instead of running the verb twice. A call that raised changed nothing, so it is not remembered:
  replaying it simply runs it again.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from agentic_lora.errors import (
    CapacityError,
    EngineRestartedError,
    InvalidStateError,
    LeaseExpiredError,
    NoPublishedVersionError,
    NotReadyError,
    PublicationBlockedError,
    ReadyMismatchError,
    RevisionConflictError,
    SessionClosedError,
    SessionExpiredError,
    SessionStillBoundError,
    StaleAttemptError,
    UnknownEngineError,
    UnknownVersionError,
    VersionConflictError,
)
from agentic_lora.identity import make_lora_name, validate_version_id
from agentic_lora.registry.transitions import VersionEvent, advance
from agentic_lora.registry.types import (
    Binding,
    CommitReceipt,
    EngineStatus,
    LeaseGrant,
    LeaseStatus,
    NamedSession,
    ReadyReceipt,
    ReclaimClaim,
    RegistryStatus,
    ReleaseResult,
    Reservation,
    ReserveOutcome,
    SessionState,
    SessionStatus,
    SweepResult,
    VersionState,
    VersionStatus,
    from_wire,
    to_wire,
)

__all__ = ["MUTATING_VERBS", "ON_RESTART", "TIMED_VERBS", "RegistryCore"]

_DIGEST = re.compile(r"^[0-9a-f]{64}$")

#: Verbs that may change state (and so take a request id and are journaled).
MUTATING_VERBS: frozenset[str] = frozenset(
    {
        "reserve",
        "record_ready",
        "observe_incarnation",
        "commit",
        "abort",
        "confirm_cleanup",
        "bind_first",
        "begin_close",
        "release",
        "forget_sessions",
        "claim_reclaim",
        "confirm_reclaim",
        "open_lease",
        "renew_lease",
        "close_lease",
        "resume_leases",
        "sweep",
        "open_named",
    }
)

#: Verbs that take ``now`` (seconds on the registry host's clock). The front end passes it in, so
#: the core stays clock-free: a journal replays every expiry exactly as it first happened. ``now``
#: is not part of a call's idempotency fingerprint (a replay carries a later time).
TIMED_VERBS: frozenset[str] = frozenset(
    {"open_lease", "renew_lease", "resume_leases", "sweep", "open_named", "begin_close"}
)

#: What a new incarnation of an owner does with its predecessor's Sessions: a rollout worker's
#: Sessions died with it ("release"); a gateway's belong to agents that outlive it ("adopt").
ON_RESTART: frozenset[str] = frozenset({"release", "adopt"})

_MAX_NAME = 256
#: Dead lease ids remembered so a late call from a dead incarnation is refused, not revived.
_DEAD_LEASE_MEMORY = 4096


class _Version:
    """Mutable bookkeeping of one version; only the core touches it."""

    __slots__ = (
        "attempt",
        "cleaned",
        "commit_receipt",
        "digest",
        "lora_name",
        "ready",
        "reclaim_id",
        "reclaimed",
        "session_refs",
        "state",
        "version_id",
    )

    def __init__(self, version_id: str, digest: str, lora_name: str) -> None:
        self.version_id = version_id
        self.digest = digest
        self.lora_name = lora_name
        self.state = VersionState.LOADING
        self.attempt = 1
        self.ready: dict[str, ReadyReceipt] = {}
        self.cleaned: set[str] = set()
        self.reclaim_id: str | None = None
        self.reclaimed: set[str] = set()
        self.session_refs = 0
        self.commit_receipt: CommitReceipt | None = None


class _Session:
    __slots__ = ("binding", "lease", "state")

    def __init__(
        self, state: SessionState, binding: Binding | None, lease: str | None = None
    ) -> None:
        self.state = state
        self.binding = binding
        self.lease = lease


class _Lease:
    """One owner incarnation's lease and what hangs on it."""

    __slots__ = ("expires_at", "incarnation", "lease_id", "names", "owner", "sessions", "ttl")

    def __init__(self, owner: str, incarnation: str, ttl: float, expires_at: float) -> None:
        self.lease_id = _lease_id(owner, incarnation)
        self.owner = owner
        self.incarnation = incarnation
        self.ttl = ttl
        self.expires_at = expires_at
        self.sessions: set[str] = set()
        self.names: set[str] = set()


class _Name:
    """A client-chosen Session name; ``closed_at`` set makes it a tombstone (kept by age)."""

    __slots__ = ("closed_at", "lease", "session_key", "why")

    def __init__(self, session_key: str, lease: str | None) -> None:
        self.session_key = session_key
        self.lease = lease
        self.closed_at: float | None = None
        self.why: str | None = None


def _lease_id(owner: str, incarnation: str) -> str:
    return f"{owner}/{incarnation}"


def _check_token(value: object, what: str) -> str:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_NAME
        or not value.isprintable()
        or any(c.isspace() for c in value)
    ):
        raise InvalidStateError(
            f"{what} must be a printable string of 1-{_MAX_NAME} characters without whitespace",
            reason=f"bad_{what}",
        )
    return value


def _check_time(value: object, what: str, *, positive: bool = False) -> float:
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


class RegistryCore:
    """The LoRA version registry as a deterministic state machine (see module docstring).

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
        self._idempotency_window = idempotency_window
        self._versions: dict[str, _Version] = {}
        self._sessions: dict[str, _Session] = {}
        self._default: str | None = None
        self._default_revision = 0
        self._pending: str | None = None
        self._incarnations: dict[str, str | None] = dict.fromkeys(self.engines)
        self._leases: dict[str, _Lease] = {}  # live leases by id
        self._owners: dict[str, str] = {}  # owner -> its current lease id
        self._dead_leases: OrderedDict[str, str] = OrderedDict()  # lease id -> why it ended
        self._names: dict[str, _Name] = {}
        self._name_of: dict[str, str] = {}  # session key -> name
        # The latest ``now`` any timed verb brought: the time of untimed transitions (a close
        # tombstones a name at this time). Never goes backwards.
        self._now = 0.0
        # request_id -> (verb, args, result); bounded FIFO so memory stays flat.
        self._done: OrderedDict[str, tuple[str, tuple[Any, ...], Any]] = OrderedDict()
        #: Number of state-changing calls applied so far (the journal's sequence number).
        self.seq = 0
        self._verbs: dict[str, Callable[..., Any]] = {v: getattr(self, v) for v in MUTATING_VERBS}

    # --- the entry point the journal and every front end use ---------------------------------

    def execute(self, request_id: str, verb: str, args: dict[str, Any]) -> tuple[Any, bool]:
        """Run one mutating verb once per ``request_id``.

        Returns ``(result, applied)``; ``applied`` is False when the result came from an earlier
        call with the same request id (nothing changed, nothing to journal).
        """
        if not request_id:
            raise InvalidStateError("request_id must be a non-empty string", reason="no_request_id")
        fingerprint = tuple(
            tuple(a) if isinstance(a, list) else a for k, a in args.items() if k != "now"
        )
        seen = self._done.get(request_id)
        if seen is not None:
            if seen[0] != verb or seen[1] != fingerprint:
                raise InvalidStateError(
                    f"request id {request_id!r} was already used for another call ({seen[0]})",
                    reason="request_id_reused",
                    request_id=request_id,
                )
            return seen[2], False
        fn = self._verbs.get(verb)
        if fn is None:
            raise InvalidStateError(f"unknown verb {verb!r}", reason="unknown_verb")
        result = fn(**args)
        self.seq += 1
        done = self._done
        done[request_id] = (verb, fingerprint, result)
        if len(done) > self._idempotency_window:
            done.popitem(last=False)
        return result, True

    # --- helpers -------------------------------------------------------------------------------

    def _version(self, version_id: str) -> _Version:
        v = self._versions.get(version_id)
        if v is None:
            raise UnknownVersionError(f"no version {version_id!r}", version=version_id)
        return v

    def _engine(self, engine: str) -> None:
        if engine not in self._incarnations:
            raise UnknownEngineError(
                f"engine {engine!r} is not in the fleet {list(self.engines)}", engine=engine
            )

    def _slots_in_use(self) -> int:
        return sum(1 for v in self._versions.values() if v.state.holds_slot)

    def _attempt(self, v: _Version, attempt: int) -> None:
        if attempt != v.attempt:
            raise StaleAttemptError(
                f"attempt {attempt} of {v.version_id!r} is superseded by attempt {v.attempt}",
                version=v.version_id,
                attempt=attempt,
                current_attempt=v.attempt,
            )

    def _vstatus(self, v: _Version) -> VersionStatus:
        return VersionStatus(
            version_id=v.version_id,
            digest=v.digest,
            lora_name=v.lora_name,
            state=v.state,
            attempt=v.attempt,
            session_refs=v.session_refs,
            ready_engines=tuple(e for e in self.engines if e in v.ready),
            cleaned_engines=tuple(e for e in self.engines if e in v.cleaned),
            reclaim_id=v.reclaim_id,
            reclaimed_engines=tuple(e for e in self.engines if e in v.reclaimed),
            published_revision=v.commit_receipt.default_revision if v.commit_receipt else None,
        )

    def _reservation(self, v: _Version, outcome: ReserveOutcome) -> Reservation:
        return Reservation(
            version_id=v.version_id,
            digest=v.digest,
            lora_name=v.lora_name,
            attempt=v.attempt,
            outcome=outcome,
            state=v.state,
            engines=self.engines,
        )

    def _claim(self, v: _Version) -> ReclaimClaim:
        assert v.reclaim_id is not None
        return ReclaimClaim(
            version_id=v.version_id,
            lora_name=v.lora_name,
            reclaim_id=v.reclaim_id,
            engines=self.engines,
            confirmed=tuple(e for e in self.engines if e in v.reclaimed),
        )

    # --- publication ---------------------------------------------------------------------------

    def reserve(self, version_id: str, digest: str) -> Reservation:
        validate_version_id(version_id)
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise ReadyMismatchError(
                "digest must be 64 lowercase hex characters (SHA-256)", version=version_id
            )
        v = self._versions.get(version_id)
        if v is not None:
            if v.digest != digest:
                # Same id, other content: refused in every state, before any engine is touched.
                raise VersionConflictError(
                    f"version {version_id!r} already names content {v.digest[:16]}, not {digest[:16]}",
                    version=version_id,
                    existing_digest=v.digest,
                    digest=digest,
                    state=v.state.value,
                )
            if v.state is VersionState.LOADING:
                return self._reservation(v, ReserveOutcome.IN_PROGRESS)
            if v.state is VersionState.ABORTED:
                raise PublicationBlockedError(
                    f"attempt {v.attempt} of {version_id!r} is aborted and its cleanup is not confirmed",
                    version=version_id,
                    attempt=v.attempt,
                )
            if v.state is VersionState.FAILED_CLEAN:
                self._admit(version_id)
                v.state = advance(version_id, v.state, VersionEvent.RETRY)
                v.attempt += 1
                v.ready.clear()
                v.cleaned.clear()
                self._pending = version_id
                return self._reservation(v, ReserveOutcome.RETRY_STARTED)
            # Committed once: a late replay is a no-op; it never reloads nor rolls the default back.
            return self._reservation(v, ReserveOutcome.ALREADY_COMPLETED)
        self._admit(version_id)
        v = _Version(
            version_id,
            digest,
            make_lora_name(self.prefix, self.deployment_epoch, version_id, digest),
        )
        self._versions[version_id] = v
        self._pending = version_id
        return self._reservation(v, ReserveOutcome.STARTED)

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

    def observe_incarnation(self, engine: str, incarnation: str) -> bool:
        self._engine(engine)
        _check_token(incarnation, "incarnation")
        known = self._incarnations[engine]
        if known == incarnation:
            return False
        self._incarnations[engine] = incarnation
        if known is None:
            return True  # the first sighting: nothing was recorded against an older process
        # A new incarnation is a new process: it holds no adapter at all. Everything recorded
        # against the old one is void, in whichever direction that cuts.
        for v in self._versions.values():
            if v.state is VersionState.LOADING or v.state.dispatchable:
                # LOADING: its READY no longer proves anything, commit must wait for a fresh
                # one. PUBLISHED/RETIRED: the engine no longer holds it, so no request for it may
                # be routed there until it is loaded again (repair) and its READY recorded.
                r = v.ready.get(engine)
                if r is not None and r.incarnation != incarnation:
                    del v.ready[engine]
            elif v.state is VersionState.ABORTED:
                # The restart is the proof of cleanup the aborted attempt was waiting for.
                self._cleaned(v, engine)
            elif v.state is VersionState.RECLAIMING:
                # Nothing loads a RECLAIMING version again (repair refuses it), so the restarted
                # engine provably holds nothing of it.
                self._reclaimed(v, engine)
        return True

    def record_ready(self, receipt: ReadyReceipt) -> VersionStatus:
        v = self._version(receipt.version_id)
        self._engine(receipt.engine)
        if receipt.digest != v.digest or receipt.lora_name != v.lora_name:
            raise ReadyMismatchError(
                f"READY from {receipt.engine} names other content than {v.version_id!r}",
                version=v.version_id,
                engine=receipt.engine,
                expected_digest=v.digest,
                digest=receipt.digest,
            )
        if v.state is not VersionState.LOADING:
            committed = v.commit_receipt is not None and receipt.attempt == v.commit_receipt.attempt
            if committed and v.state.dispatchable:
                # A repair (the engine restarted and got the version again), or a late duplicate
                # of the READY commit used: either way it counts only for the current process.
                self._current_incarnation(v, receipt)
                v.ready[receipt.engine] = receipt
                return self._vstatus(v)
            if committed:
                return self._vstatus(v)  # a late duplicate; the version is on its way out
            if receipt.attempt < v.attempt:
                self._attempt(v, receipt.attempt)
            raise InvalidStateError(
                f"version {v.version_id!r} is {v.state.value}; READY is only taken while LOADING",
                version=v.version_id,
                state=v.state.value,
            )
        self._attempt(v, receipt.attempt)
        self._current_incarnation(v, receipt)
        v.ready[receipt.engine] = receipt
        return self._vstatus(v)

    def _current_incarnation(self, v: _Version, receipt: ReadyReceipt) -> None:
        known = self._incarnations[receipt.engine]
        if known is None:
            self._incarnations[receipt.engine] = receipt.incarnation
        elif known != receipt.incarnation:
            raise EngineRestartedError(
                f"READY from {receipt.engine} incarnation {receipt.incarnation!r}, "
                f"but the engine is now {known!r}",
                version=v.version_id,
                engine=receipt.engine,
                incarnation=receipt.incarnation,
                current_incarnation=known,
            )

    def commit(
        self, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        v = self._version(version_id)
        if v.commit_receipt is not None and v.commit_receipt.attempt == attempt:
            return v.commit_receipt  # retried commit: same receipt, default untouched
        if v.state is not VersionState.LOADING:
            advance(version_id, v.state, VersionEvent.COMMIT)  # raises InvalidStateError
        self._attempt(v, attempt)
        if expected_default_revision != self._default_revision:
            raise RevisionConflictError(
                f"default revision is {self._default_revision}, not {expected_default_revision}",
                version=version_id,
                default_revision=self._default_revision,
            )
        missing = [
            e
            for e in self.engines
            if (r := v.ready.get(e)) is None or r.incarnation != self._incarnations[e]
        ]
        if missing:
            raise NotReadyError(
                f"{version_id!r} attempt {attempt} lacks READY from {missing}",
                version=version_id,
                attempt=attempt,
                missing=missing,
            )
        previous = self._default
        new_state = advance(version_id, v.state, VersionEvent.COMMIT)
        if previous is not None:
            old = self._versions[previous]
            old.state = advance(previous, old.state, VersionEvent.SUPERSEDE)
        v.state = new_state
        self._default = version_id
        self._default_revision += 1
        self._pending = None
        v.commit_receipt = CommitReceipt(
            version_id=version_id,
            lora_name=v.lora_name,
            attempt=attempt,
            default_revision=self._default_revision,
            previous_default=previous,
        )
        return v.commit_receipt

    def abort(self, version_id: str, attempt: int, reason: str) -> VersionStatus:
        v = self._version(version_id)
        if v.state in (VersionState.ABORTED, VersionState.FAILED_CLEAN) and attempt == v.attempt:
            return self._vstatus(v)
        self._attempt(v, attempt)
        v.state = advance(version_id, v.state, VersionEvent.ABORT)
        v.ready.clear()
        return self._vstatus(v)

    def confirm_cleanup(self, version_id: str, attempt: int, engine: str) -> VersionStatus:
        v = self._version(version_id)
        self._engine(engine)
        self._attempt(v, attempt)
        if v.state is VersionState.FAILED_CLEAN:
            return self._vstatus(v)
        if v.state is not VersionState.ABORTED:
            raise InvalidStateError(
                f"version {version_id!r} is {v.state.value}; cleanup is confirmed only after abort",
                version=version_id,
                state=v.state.value,
            )
        self._cleaned(v, engine)
        return self._vstatus(v)

    def _cleaned(self, v: _Version, engine: str) -> None:
        v.cleaned.add(engine)
        if len(v.cleaned) == len(self.engines):
            # Only now is it proven that no engine holds the candidate: free the slot.
            v.state = advance(v.version_id, v.state, VersionEvent.ALL_CLEANED)
            if self._pending == v.version_id:
                self._pending = None

    # --- Sessions -------------------------------------------------------------------------------

    def bind_first(self, session_key: str, lease: str | None = None) -> Binding:
        s = self._sessions.get(session_key)
        if s is not None:
            if s.state is SessionState.BOUND:
                assert s.binding is not None
                return s.binding  # the first answer, whatever the default is now
            raise self._refusal(session_key, s.state)
        name = self._name_of.get(session_key)
        if name is not None:
            # A named Session binds under its name's lease (a gateway may have adopted it).
            rec = self._names[name]
            if rec.closed_at is not None:
                raise self._name_refusal(name, rec)
            lease = rec.lease
        owner = self._live_lease(lease) if lease is not None else None
        if self._default is None:
            raise NoPublishedVersionError("no version has been published yet", session=session_key)
        v = self._versions[self._default]
        v.session_refs += 1
        binding = Binding(
            session_key=session_key,
            version_id=v.version_id,
            lora_name=v.lora_name,
            digest=v.digest,
            default_revision=self._default_revision,
        )
        self._sessions[session_key] = _Session(SessionState.BOUND, binding, lease)
        if owner is not None:
            owner.sessions.add(session_key)
        return binding

    def _refusal(self, session_key: str, state: SessionState) -> Exception:
        if state is SessionState.EXPIRED:
            return SessionExpiredError(
                f"session {session_key!r} expired with its owner's lease; it can only be closed",
                session=session_key,
                state=state.value,
            )
        return SessionClosedError(
            f"session {session_key!r} is {state.value}; it cannot bind",
            session=session_key,
            state=state.value,
        )

    def begin_close(self, session_key: str, now: float | None = None) -> SessionStatus:
        # ``now`` dates a named Session's tombstone (its age bounds how long the name stays
        # refused); without it (a direct core call) the registry's latest time is used.
        if now is not None:
            self._tick(_check_time(now, "now"))
        s = self._sessions.get(session_key)
        if s is None:
            # Close before bind: keep a record so a late bind is refused.
            s = self._sessions[session_key] = _Session(SessionState.CLOSING, None)
        elif s.state is SessionState.BOUND:
            s.state = SessionState.CLOSING
        name = self._name_of.get(session_key)
        if name is not None:
            # From now on the name can never open a second lifecycle (on any gateway replica).
            self._tombstone(name, "closed")
        return self._sstatus(session_key, s)

    def release(self, session_key: str) -> ReleaseResult:
        s = self._sessions.get(session_key)
        if s is None:
            raise InvalidStateError(
                f"session {session_key!r} is unknown; begin_close first",
                session=session_key,
                reason="unknown_session",
            )
        version_id = s.binding.version_id if s.binding is not None else None
        if s.state in (SessionState.CLOSED, SessionState.EXPIRED):
            # EXPIRED: the lease expiry already dropped the ref; closing it late changes nothing.
            return ReleaseResult(session_key, version_id, released_now=False)
        if s.state is not SessionState.CLOSING:
            raise InvalidStateError(
                f"session {session_key!r} is {s.state.value}; begin_close first",
                session=session_key,
                state=s.state.value,
            )
        s.state = SessionState.CLOSED
        if version_id is not None:
            self._versions[version_id].session_refs -= 1
        self._detach(session_key, s)
        return ReleaseResult(session_key, version_id, released_now=True)

    def forget_sessions(self, session_keys: Sequence[str]) -> int:
        keys = list(session_keys)
        live = [k for k in keys if (s := self._sessions.get(k)) is not None and s.state.holds_ref]
        if live:
            raise SessionStillBoundError(
                f"{len(live)} session(s) are not released yet", sessions=live[:8]
            )
        forgotten = 0
        for k in keys:
            if self._sessions.pop(k, None) is not None:
                forgotten += 1
        # A named Session's name (and its key mapping) outlives the record: it is a tombstone
        # kept by age (see sweep), so the name can never open a second lifecycle meanwhile.
        return forgotten

    def _sstatus(self, session_key: str, s: _Session) -> SessionStatus:
        return SessionStatus(
            session_key,
            s.state,
            s.binding.version_id if s.binding is not None else None,
            s.lease,
        )

    def _detach(self, session_key: str, s: _Session) -> None:
        if s.lease is not None and (lease := self._leases.get(s.lease)) is not None:
            lease.sessions.discard(session_key)

    def _expire_session(self, session_key: str) -> bool:
        """Drop a Session's ref because its lease ended; True if it held one."""
        s = self._sessions.get(session_key)
        if s is None or not s.state.holds_ref:
            return False
        if s.binding is not None:
            self._versions[s.binding.version_id].session_refs -= 1
        s.state = SessionState.EXPIRED
        self._detach(session_key, s)
        return True

    # --- leases -------------------------------------------------------------------------------

    def _live_lease(self, lease_id: str) -> _Lease:
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
        self._now = max(self._now, now)

    def _end_lease(self, lease: _Lease, why: str) -> tuple[str, ...]:
        """Expire every Session and name of ``lease`` and forget it; the keys that held a ref."""
        released = tuple(k for k in sorted(lease.sessions) if self._expire_session(k))
        for name in sorted(lease.names):
            self._tombstone(name, why)
        del self._leases[lease.lease_id]
        if self._owners.get(lease.owner) == lease.lease_id:
            del self._owners[lease.owner]
        self._dead_leases[lease.lease_id] = why
        while len(self._dead_leases) > _DEAD_LEASE_MEMORY:
            self._dead_leases.popitem(last=False)
        return released

    def _grant(
        self, lease: _Lease, released: tuple[str, ...] = (), adopted: tuple[str, ...] = ()
    ) -> LeaseGrant:
        return LeaseGrant(
            lease_id=lease.lease_id,
            owner=lease.owner,
            incarnation=lease.incarnation,
            ttl=lease.ttl,
            expires_at=lease.expires_at,
            released=released,
            adopted=adopted,
        )

    def open_lease(
        self, owner: str, incarnation: str, ttl: float, now: float, on_restart: str = "release"
    ) -> LeaseGrant:
        _check_token(owner, "owner")
        _check_token(incarnation, "incarnation")
        ttl = _check_time(ttl, "ttl", positive=True)
        now = _check_time(now, "now")
        if on_restart not in ON_RESTART:
            raise InvalidStateError(
                f"on_restart must be one of {sorted(ON_RESTART)}", reason="bad_on_restart"
            )
        lease_id = _lease_id(owner, incarnation)
        current = self._leases.get(lease_id)
        if current is not None:
            self._tick(now)
            current.ttl = ttl
            current.expires_at = now + ttl
            return self._grant(current)
        if lease_id in self._dead_leases:
            self._live_lease(lease_id)  # raises: an incarnation never comes back
        self._tick(now)
        lease = _Lease(owner, incarnation, ttl, now + ttl)
        released: tuple[str, ...] = ()
        adopted: tuple[str, ...] = ()
        previous_id = self._owners.get(owner)
        if previous_id is not None:
            previous = self._leases[previous_id]
            if on_restart == "adopt":
                # The agents behind a gateway outlive it: their Sessions move to the new lease.
                adopted = tuple(sorted(previous.sessions))
                for key in adopted:
                    self._sessions[key].lease = lease_id
                for name in previous.names:
                    self._names[name].lease = lease_id
                lease.sessions, lease.names = previous.sessions, previous.names
                previous.sessions, previous.names = set(), set()
            # A worker's Sessions died with it: release them now instead of after the TTL.
            released = self._end_lease(previous, "owner_restarted")
        self._leases[lease_id] = lease
        self._owners[owner] = lease_id
        return self._grant(lease, released, adopted)

    def renew_lease(self, owner: str, incarnation: str, now: float) -> LeaseGrant:
        now = _check_time(now, "now")
        lease = self._live_lease(_lease_id(owner, incarnation))
        self._tick(now)
        lease.expires_at = now + lease.ttl
        return self._grant(lease)

    def close_lease(self, owner: str, incarnation: str) -> tuple[str, ...]:
        """End a lease on purpose (an owner shutting down); returns the Sessions it released."""
        lease = self._leases.get(_lease_id(owner, incarnation))
        if lease is None:
            return ()  # already ended (expired, superseded, or a replayed close)
        return self._end_lease(lease, "owner_closed")

    def resume_leases(self, now: float) -> int:
        """Give every live lease a full TTL from ``now`` (after the registry itself was down:
        its owners could not renew while it was gone). Returns how many leases it extended."""
        now = _check_time(now, "now")
        self._tick(now)
        for lease in self._leases.values():
            lease.expires_at = max(lease.expires_at, now + lease.ttl)
        return len(self._leases)

    def sweep(self, now: float, name_ttl: float) -> SweepResult:
        """Expire every lease past its deadline; forget name tombstones older than ``name_ttl``."""
        now = _check_time(now, "now")
        name_ttl = _check_time(name_ttl, "name_ttl", positive=True)
        self._tick(now)
        expired = sorted(lid for lid, lease in self._leases.items() if lease.expires_at <= now)
        sessions: list[str] = []
        for lease_id in expired:
            sessions.extend(self._end_lease(self._leases[lease_id], "expired"))
        stale = [
            n
            for n, rec in self._names.items()
            if rec.closed_at is not None and rec.closed_at + name_ttl <= now
        ]
        for name in stale:
            rec = self._names.pop(name)
            if self._name_of.get(rec.session_key) == name:
                del self._name_of[rec.session_key]
        return SweepResult(tuple(expired), tuple(sessions), len(stale))

    # --- durable Session names ---------------------------------------------------------------

    def open_named(
        self, name: str, session_key: str, lease: str | None, now: float
    ) -> NamedSession:
        """The registry Session behind a client's Session ``name``, created on first use.

        A known, live name answers its existing Session (moved to ``lease`` if another lease
        held it); its binding, if any, is the one it had: a restarted gateway can never re-bind
        a running agent to a newer version. A closed or expired name is refused.
        """
        _check_token(name, "name")
        _check_token(session_key, "session_key")
        now = _check_time(now, "now")
        owner = self._live_lease(lease) if lease is not None else None
        rec = self._names.get(name)
        if rec is not None:
            if rec.closed_at is not None:
                raise self._name_refusal(name, rec)
            self._tick(now)
            adopted = rec.lease != lease
            if adopted:
                self._move_name(name, rec, owner)
            s = self._sessions.get(rec.session_key)
            return NamedSession(
                name,
                rec.session_key,
                rec.lease,
                s.binding if s is not None else None,
                adopted=adopted,
            )
        if session_key in self._sessions or session_key in self._name_of:
            raise InvalidStateError(
                f"session key {session_key!r} is already in use", reason="session_key_in_use"
            )
        self._tick(now)
        self._names[name] = _Name(session_key, lease)
        self._name_of[session_key] = name
        if owner is not None:
            owner.names.add(name)
        return NamedSession(name, session_key, lease)

    def _move_name(self, name: str, rec: _Name, owner: _Lease | None) -> None:
        if rec.lease is not None and (old := self._leases.get(rec.lease)) is not None:
            old.names.discard(name)
            old.sessions.discard(rec.session_key)
        rec.lease = owner.lease_id if owner is not None else None
        if owner is not None:
            owner.names.add(name)
        s = self._sessions.get(rec.session_key)
        if s is not None:
            s.lease = rec.lease
            if owner is not None and s.state.holds_ref:
                owner.sessions.add(rec.session_key)

    def _tombstone(self, name: str, why: str) -> None:
        rec = self._names.get(name)
        if rec is None or rec.closed_at is not None:
            return
        rec.closed_at = self._now
        rec.why = why
        if rec.lease is not None and (lease := self._leases.get(rec.lease)) is not None:
            lease.names.discard(name)

    def _name_refusal(self, name: str, rec: _Name) -> Exception:
        if rec.why == "closed":
            return SessionClosedError(
                f"session {name!r} was closed; start a new Session with a new id",
                session=name,
                reason="closed",
            )
        return SessionExpiredError(
            f"session {name!r} expired ({rec.why}); start a new Session with a new id",
            session=name,
            reason=rec.why,
        )

    # --- reclaim --------------------------------------------------------------------------------

    def claim_reclaim(self, version_id: str) -> ReclaimClaim:
        v = self._version(version_id)
        if v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            return self._claim(v)
        if v.state is VersionState.RETIRED and v.session_refs > 0:
            raise SessionStillBoundError(
                f"{v.session_refs} session(s) still hold {version_id!r}",
                version=version_id,
                session_refs=v.session_refs,
            )
        v.state = advance(version_id, v.state, VersionEvent.CLAIM_RECLAIM)
        # From here on no request for this version may be dispatched.
        v.reclaim_id = f"reclaim-{self.deployment_epoch}-{version_id}"
        return self._claim(v)

    def confirm_reclaim(self, version_id: str, reclaim_id: str, engine: str) -> VersionStatus:
        v = self._version(version_id)
        self._engine(engine)
        if v.reclaim_id is None or v.reclaim_id != reclaim_id:
            raise StaleAttemptError(
                f"reclaim id {reclaim_id!r} does not match {version_id!r}'s ({v.reclaim_id!r})",
                version=version_id,
                reclaim_id=reclaim_id,
            )
        if v.state is VersionState.RECLAIMED:
            return self._vstatus(v)
        self._reclaimed(v, engine)
        return self._vstatus(v)

    def _reclaimed(self, v: _Version, engine: str) -> None:
        v.reclaimed.add(engine)
        if len(v.reclaimed) == len(self.engines):
            v.state = advance(v.version_id, v.state, VersionEvent.ALL_RECLAIMED)

    # --- reads (no request id, never journaled) ------------------------------------------------

    def peek_version(self, version_id: str) -> VersionStatus | None:
        v = self._versions.get(version_id)
        return None if v is None else self._vstatus(v)

    def version(self, version_id: str) -> VersionStatus:
        return self._vstatus(self._version(version_id))

    def state_of(self, version_id: str) -> VersionState | None:
        """The cheapest read, for the dispatch hot path."""
        v = self._versions.get(version_id)
        return None if v is None else v.state

    def session(self, session_key: str) -> SessionStatus | None:
        s = self._sessions.get(session_key)
        return None if s is None else self._sstatus(session_key, s)

    def sweep_due(self, now: float, name_ttl: float) -> bool:
        """Whether :meth:`sweep` at ``now`` would change anything (a read: nothing journaled)."""
        return any(lease.expires_at <= now for lease in self._leases.values()) or any(
            rec.closed_at is not None and rec.closed_at + name_ttl <= now
            for rec in self._names.values()
        )

    def named(self, name: str) -> NamedSession | None:
        """The live Session behind ``name`` (None if unknown or tombstoned)."""
        rec = self._names.get(name)
        if rec is None or rec.closed_at is not None:
            return None
        s = self._sessions.get(rec.session_key)
        return NamedSession(name, rec.session_key, rec.lease, s.binding if s else None)

    def lease(self, lease_id: str) -> LeaseStatus | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else self._lstatus(lease)

    def _lstatus(self, lease: _Lease) -> LeaseStatus:
        return LeaseStatus(
            lease_id=lease.lease_id,
            owner=lease.owner,
            incarnation=lease.incarnation,
            ttl=lease.ttl,
            expires_at=lease.expires_at,
            sessions=len(lease.sessions),
            names=len(lease.names),
        )

    @property
    def now(self) -> float:
        """The latest time a timed verb brought (the registry's notion of "now" for replay)."""
        return self._now

    @property
    def default_revision(self) -> int:
        return self._default_revision

    @property
    def default_version(self) -> str | None:
        return self._default

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def status(self) -> RegistryStatus:
        return RegistryStatus(
            deployment_epoch=self.deployment_epoch,
            capacity=self.capacity,
            engines=tuple(EngineStatus(e, self._incarnations[e]) for e in self.engines),
            default_version=self._default,
            default_revision=self._default_revision,
            slots_in_use=self._slots_in_use(),
            pending_version=self._pending,
            versions=tuple(self._vstatus(v) for v in self._versions.values()),
            live_sessions=sum(1 for s in self._sessions.values() if s.state.holds_ref),
            leases=tuple(self._lstatus(lease) for lease in self._leases.values()),
            named_sessions=sum(1 for rec in self._names.values() if rec.closed_at is None),
        )

    # --- snapshot (journal compaction) ---------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """A JSON-able image of everything, including remembered results of recent calls."""
        return {
            "seq": self.seq,
            "default": self._default,
            "default_revision": self._default_revision,
            "pending": self._pending,
            "incarnations": self._incarnations,
            "versions": [
                {
                    "version_id": v.version_id,
                    "digest": v.digest,
                    "lora_name": v.lora_name,
                    "state": v.state.value,
                    "attempt": v.attempt,
                    "ready": [to_wire(r) for r in v.ready.values()],
                    "cleaned": sorted(v.cleaned),
                    "reclaim_id": v.reclaim_id,
                    "reclaimed": sorted(v.reclaimed),
                    "session_refs": v.session_refs,
                    "commit_receipt": to_wire(v.commit_receipt),
                }
                for v in self._versions.values()
            ],
            "sessions": [
                [k, s.state.value, to_wire(s.binding), s.lease] for k, s in self._sessions.items()
            ],
            "now": self._now,
            "leases": [
                [
                    lease.owner,
                    lease.incarnation,
                    lease.ttl,
                    lease.expires_at,
                    sorted(lease.sessions),
                    sorted(lease.names),
                ]
                for lease in self._leases.values()
            ],
            "owners": self._owners,
            "dead_leases": [[k, why] for k, why in self._dead_leases.items()],
            "names": [
                [n, rec.session_key, rec.lease, rec.closed_at, rec.why]
                for n, rec in self._names.items()
            ],
            "done": [
                [rid, verb, to_wire(list(fp)), to_wire(res)]
                for rid, (verb, fp, res) in self._done.items()
            ],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`to_state` (on a fresh core with the same fleet and capacity)."""
        self.seq = int(state["seq"])
        self._default = state["default"]
        self._default_revision = int(state["default_revision"])
        self._pending = state["pending"]
        self._incarnations = dict(state["incarnations"])
        self._versions = {}
        for raw in state["versions"]:
            v = _Version(raw["version_id"], raw["digest"], raw["lora_name"])
            v.state = VersionState(raw["state"])
            v.attempt = int(raw["attempt"])
            for r in raw["ready"]:
                receipt = from_wire(r)
                v.ready[receipt.engine] = receipt
            v.cleaned = set(raw["cleaned"])
            v.reclaim_id = raw["reclaim_id"]
            v.reclaimed = set(raw["reclaimed"])
            v.session_refs = int(raw["session_refs"])
            v.commit_receipt = from_wire(raw["commit_receipt"])
            self._versions[v.version_id] = v
        self._sessions = {
            k: _Session(SessionState(st), from_wire(b), lease)
            for k, st, b, lease in state["sessions"]
        }
        self._now = float(state["now"])
        self._leases = {}
        for owner, incarnation, ttl, expires_at, sessions, names in state["leases"]:
            lease = _Lease(owner, incarnation, float(ttl), float(expires_at))
            lease.sessions = set(sessions)
            lease.names = set(names)
            self._leases[lease.lease_id] = lease
        self._owners = dict(state["owners"])
        self._dead_leases = OrderedDict((k, why) for k, why in state["dead_leases"])
        self._names = {}
        self._name_of = {}
        for n, key, lease_id, closed_at, why in state["names"]:
            rec = _Name(key, lease_id)
            rec.closed_at = closed_at
            rec.why = why
            self._names[n] = rec
            self._name_of[key] = n
        self._done = OrderedDict(
            (rid, (verb, _freeze(from_wire(fp)), from_wire(res)))
            for rid, verb, fp, res in state["done"]
        )


def _freeze(value: Iterable[Any]) -> tuple[Any, ...]:
    """Rebuild an args fingerprint (JSON turned its inner tuples into lists)."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in value)
