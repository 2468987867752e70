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

The core holds every verb's entry point and the publication and reclaim rules, all driven by the
one transition table of :mod:`~agentic_lora.registry.transitions`. Its state and shared lookups are
:class:`~agentic_lora.registry.state.RegistryState`; the other rules are functions over that state
in their own modules: :mod:`~agentic_lora.registry.session_lifecycle`,
:mod:`~agentic_lora.registry.owner_leases`, :mod:`~agentic_lora.registry.durable_names`,
:mod:`~agentic_lora.registry.engine_incarnations`, :mod:`~agentic_lora.registry.idempotency`,
:mod:`~agentic_lora.registry.views` and :mod:`~agentic_lora.registry.snapshot`. Each runs inside
one of the core's atomic steps.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import ReadyMismatchError
from agentic_lora.errors import SessionStillBoundError
from agentic_lora.errors import StaleAttemptError
from agentic_lora.errors import VersionConflictError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.foundation.identity import validate_version_id
from agentic_lora.registry import durable_names
from agentic_lora.registry import engine_incarnations
from agentic_lora.registry import membership
from agentic_lora.registry import owner_leases
from agentic_lora.registry import rollback
from agentic_lora.registry import session_lifecycle
from agentic_lora.registry import snapshot
from agentic_lora.registry.engine_incarnations import check_current_incarnation
from agentic_lora.registry.idempotency import fingerprint
from agentic_lora.registry.owner_leases import ON_RESTART
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import VersionRecord
from agentic_lora.registry.transitions import VersionEvent
from agentic_lora.registry.transitions import advance
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import DispatchView
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import LeaseStatus
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import NamedSession
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import ReclaimClaim
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import SessionStatus
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.views import dispatch_view
from agentic_lora.registry.views import lease_status
from agentic_lora.registry.views import reclaim_claim
from agentic_lora.registry.views import registry_status
from agentic_lora.registry.views import reservation
from agentic_lora.registry.views import session_status
from agentic_lora.registry.views import version_status

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
        "reserve_rollback",
        "rollback",
        "join_engine",
        "activate_engine",
        "drain_engine",
        "eject_engine",
        "remove_engine",
    }
)

#: Verbs that take ``now`` (seconds on the registry host's clock). The front end passes it in, so
#: the core stays clock-free: a journal replays every expiry exactly as it first happened. ``now``
#: is not part of a call's idempotency fingerprint (a replay carries a later time).
TIMED_VERBS: frozenset[str] = frozenset(
    {"open_lease", "renew_lease", "resume_leases", "sweep", "open_named", "begin_close"}
)


class RegistryCore(RegistryState):
    """The LoRA version registry as a deterministic state machine (see module docstring).

    Constructed as :class:`~agentic_lora.registry.state.RegistryState` (engines, capacity, ...).
    """

    # --- the entry point the journal and every front end use ---------------------------------

    def execute(self, request_id: str, verb: str, args: dict[str, Any]) -> tuple[Any, bool]:
        """Run one mutating verb once per ``request_id``.

        Returns ``(result, applied)``; ``applied`` is False when the result came from an earlier
        call with the same request id (nothing changed, nothing to journal).
        """
        if not request_id:
            raise InvalidStateError("request_id must be a non-empty string", reason="no_request_id")
        fp = fingerprint(args)
        seen, earlier = self._done.recall(request_id, verb, fp)
        if seen:
            return earlier, False
        result = self.apply(verb, args)
        self._done.remember(request_id, verb, fp, result)
        return result, True

    def apply(self, verb: str, args: dict[str, Any]) -> Any:
        """Run one mutating verb without remembering its request id: for a caller in this
        process, which has no reply to lose and so never replays. Not for a journaled registry
        (every journal row carries the request id its replays are answered by)."""
        # Only the declared mutating verbs: an arbitrary attribute name is never callable here.
        fn: Callable[..., Any] | None = getattr(self, verb) if verb in MUTATING_VERBS else None
        if fn is None:
            raise InvalidStateError(f"unknown verb {verb!r}", reason="unknown_verb")
        result = fn(**args)
        self.seq += 1
        return result

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
            if v.state is VersionState.LOADING and v.committed_before:
                # A rollback is loading it again; a publication never joins (nor commits) that.
                raise PublicationBlockedError(
                    f"a rollback to {version_id!r} is loading it (attempt {v.attempt})",
                    version=version_id,
                    pending=version_id,
                    attempt=v.attempt,
                )
            if v.state is VersionState.LOADING:
                return reservation(self, v, ReserveOutcome.IN_PROGRESS)
            if v.state is VersionState.ABORTED:
                raise PublicationBlockedError(
                    f"attempt {v.attempt} of {version_id!r} is aborted and its cleanup is not confirmed",
                    version=version_id,
                    attempt=v.attempt,
                )
            if v.state is VersionState.FAILED_CLEAN:
                self._admit(version_id)
                v.state = advance(version_id, v.state, VersionEvent.RETRY)
                v.ref = dataclasses.replace(v.ref, attempt=v.attempt + 1)
                v.ready.clear()
                v.cleaned.clear()
                self._pending = version_id
                return reservation(self, v, ReserveOutcome.RETRY_STARTED)
            # Committed once: a late replay is a no-op; it never reloads nor rolls the default back.
            return reservation(self, v, ReserveOutcome.ALREADY_COMPLETED)
        self._admit(version_id)
        lora_name = make_lora_name(self.prefix, self.deployment_epoch, version_id, digest)
        v = VersionRecord(VersionRef(version_id, digest, lora_name, attempt=1))
        self._versions[version_id] = v
        self._pending = version_id
        return reservation(self, v, ReserveOutcome.STARTED)

    def observe_incarnation(self, engine: str, incarnation: str) -> bool:
        return engine_incarnations.observe_incarnation(self, engine, incarnation)

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
                check_current_incarnation(self, v, receipt)
                v.ready[receipt.engine] = receipt
                return version_status(self, v)
            if committed:
                return version_status(self, v)  # a late duplicate; the version is on its way out
            if receipt.attempt < v.attempt:
                self._attempt(v, receipt.attempt)
            raise InvalidStateError(
                f"version {v.version_id!r} is {v.state.value}; READY is only taken while LOADING",
                version=v.version_id,
                state=v.state.value,
            )
        self._attempt(v, receipt.attempt)
        check_current_incarnation(self, v, receipt)
        v.ready[receipt.engine] = receipt
        return version_status(self, v)

    def commit(
        self, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        v = self._version(version_id)
        if v.commit_receipt is not None and v.commit_receipt.attempt == attempt:
            return v.commit_receipt  # retried commit: same receipt, default untouched
        if v.state is not VersionState.LOADING:
            advance(version_id, v.state, VersionEvent.COMMIT)  # raises InvalidStateError
        return self._move_default(v, attempt, expected_default_revision, VersionEvent.COMMIT)

    def abort(self, version_id: str, attempt: int, reason: str) -> VersionStatus:
        v = self._version(version_id)
        if v.state in (VersionState.ABORTED, VersionState.FAILED_CLEAN) and attempt == v.attempt:
            return version_status(self, v)
        self._attempt(v, attempt)
        v.state = advance(version_id, v.state, VersionEvent.ABORT)
        v.ready.clear()
        return version_status(self, v)

    def confirm_cleanup(self, version_id: str, attempt: int, engine: str) -> VersionStatus:
        v = self._version(version_id)
        self._engine(engine)
        self._attempt(v, attempt)
        if v.state is VersionState.FAILED_CLEAN:
            return version_status(self, v)
        if v.state is not VersionState.ABORTED:
            raise InvalidStateError(
                f"version {version_id!r} is {v.state.value}; cleanup is confirmed only after abort",
                version=version_id,
                state=v.state.value,
            )
        self._cleaned(v, engine)
        return version_status(self, v)

    # --- rollback (rules in rollback) ----------------------------------------------------------

    def reserve_rollback(self, version_id: str) -> Reservation:
        """A rollback to a RECLAIMED version: RECLAIMED -> LOADING, a new attempt of the same
        content, its slot admitted first (see :mod:`~agentic_lora.registry.rollback`)."""
        return rollback.reserve_rollback(self, version_id)

    def rollback(
        self, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        """A rollback to a RETIRED version: it becomes the default again once every engine holds
        ``attempt`` (see :mod:`~agentic_lora.registry.rollback`)."""
        return rollback.rollback(self, version_id, attempt, expected_default_revision)

    # --- membership (rules in membership) -------------------------------------------------------

    def join_engine(self, engine: str) -> MemberState:
        """A new engine joins the fleet as JOINING: not routable, not counted for readiness."""
        return membership.join(self, engine)

    def activate_engine(self, engine: str, incarnation: str) -> MemberState:
        """JOINING or EJECTED -> ACTIVE, once ``engine``'s observed ``incarnation`` holds every
        dispatchable version (MEMBER_NOT_READY otherwise)."""
        return membership.activate(self, engine, incarnation)

    def drain_engine(self, engine: str) -> MemberState:
        """ACTIVE or JOINING -> DRAINING: no new work; removed once its in-flight work ends."""
        return membership.drain(self, engine)

    def eject_engine(self, engine: str, incarnation: str | None) -> MemberState:
        """-> EJECTED (failed health probes), fenced by ``incarnation``."""
        return membership.eject(self, engine, incarnation)

    def remove_engine(self, engine: str) -> MemberState:
        """DRAINING or EJECTED -> REMOVED: the engine leaves the fleet."""
        return membership.remove(self, engine)

    def member_state(self, engine: str) -> MemberState:
        """An engine's membership (a read; REMOVED for an engine not in the fleet)."""
        return membership.member_state(self, engine)

    # --- Sessions (rules in session_lifecycle) -------------------------------------------------

    def bind_first(self, session_key: str, lease: str | None = None) -> Binding:
        return session_lifecycle.bind_first(self, session_key, lease)

    def begin_close(self, session_key: str, now: float | None = None) -> SessionStatus:
        return session_lifecycle.begin_close(self, session_key, now)

    def release(self, session_key: str) -> ReleaseResult:
        return session_lifecycle.release(self, session_key)

    def forget_sessions(self, session_keys: Sequence[str]) -> int:
        return session_lifecycle.forget_sessions(self, session_keys)

    def close_session_now(
        self, session_key: str, now: float
    ) -> tuple[SessionStatus, ReleaseResult]:
        """``begin_close``, ``release`` and ``forget_sessions([session_key])`` as one step (see
        :func:`~agentic_lora.registry.session_lifecycle.close_now`). Not a verb: nothing remembers
        a request id and nothing is journaled, so it is only for a registry without a journal,
        called in its own process (:meth:`LocalRegistry.close_session_now`)."""
        answers = session_lifecycle.close_now(self, session_key, now)
        self.seq += 3  # the three verbs it stands for
        return answers

    # --- owner leases and durable Session names (rules in owner_leases / durable_names) -------

    def open_lease(
        self, owner: str, incarnation: str, ttl: float, now: float, on_restart: str = "release"
    ) -> LeaseGrant:
        return owner_leases.open_lease(self, owner, incarnation, ttl, now, on_restart)

    def renew_lease(self, owner: str, incarnation: str, now: float) -> LeaseGrant:
        return owner_leases.renew_lease(self, owner, incarnation, now)

    def close_lease(self, owner: str, incarnation: str) -> tuple[str, ...]:
        """End a lease on purpose (an owner shutting down); returns the Sessions it released."""
        return owner_leases.close_lease(self, owner, incarnation)

    def resume_leases(self, now: float) -> int:
        """Give every live lease a full TTL from ``now`` (after the registry itself was down:
        its owners could not renew while it was gone). Returns how many leases it extended."""
        return owner_leases.resume_leases(self, now)

    def sweep(self, now: float, name_ttl: float) -> SweepResult:
        """Expire every lease past its deadline; forget name tombstones older than ``name_ttl``."""
        return owner_leases.sweep(self, now, name_ttl)

    def open_named(
        self, name: str, session_key: str, lease: str | None, now: float
    ) -> NamedSession:
        """The registry Session behind a client's Session ``name``, created on first use.

        A known, live name answers its existing Session (moved to ``lease`` if another lease
        held it); its binding, if any, is the one it had: a restarted gateway can never re-bind
        a running agent to a newer version. A closed or expired name is refused.
        """
        return durable_names.open_named(self, name, session_key, lease, now)

    # --- reclaim --------------------------------------------------------------------------------

    def claim_reclaim(self, version_id: str) -> ReclaimClaim:
        v = self._version(version_id)
        if v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            return reclaim_claim(self, v)
        if v.state is VersionState.RETIRED and v.session_refs > 0:
            raise SessionStillBoundError(
                f"{v.session_refs} session(s) still hold {version_id!r}",
                version=version_id,
                session_refs=v.session_refs,
            )
        v.state = advance(version_id, v.state, VersionEvent.CLAIM_RECLAIM)
        # From here on no request for this version may be dispatched.
        v.reclaim_id = self.reclaim_id_of(v)
        return reclaim_claim(self, v)

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
            return version_status(self, v)
        self._reclaimed(v, engine)
        return version_status(self, v)

    # --- reads (no request id, never journaled) ------------------------------------------------

    def peek_version(self, version_id: str) -> VersionStatus | None:
        v = self._versions.get(version_id)
        return None if v is None else version_status(self, v)

    def dispatch_view(self, version_id: str) -> DispatchView | None:
        """The dispatch guard's read of :meth:`peek_version`'s state, name and ready engines."""
        v = self._versions.get(version_id)
        return None if v is None else dispatch_view(self, v)

    def version(self, version_id: str) -> VersionStatus:
        return version_status(self, self._version(version_id))

    def state_of(self, version_id: str) -> VersionState | None:
        """The cheapest read, for the dispatch hot path."""
        v = self._versions.get(version_id)
        return None if v is None else v.state

    def session(self, session_key: str) -> SessionStatus | None:
        s = self._sessions.get(session_key)
        return None if s is None else session_status(session_key, s)

    def sweep_due(self, now: float, name_ttl: float) -> bool:
        """Whether :meth:`sweep` at ``now`` would change anything (a read: nothing journaled)."""
        return owner_leases.sweep_due(self, now, name_ttl)

    def holds_deadlines(self) -> bool:
        """Whether the registry holds a lease or a durable name: something a sweep may one day
        expire or forget, so the registry host must keep sweeping (a read: nothing journaled)."""
        return bool(self._leases) or bool(self._names)

    def named(self, name: str) -> NamedSession | None:
        """The live Session behind ``name`` (None if unknown or tombstoned)."""
        return durable_names.named(self, name)

    def lease(self, lease_id: str) -> LeaseStatus | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else lease_status(lease)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def status(self) -> RegistryStatus:
        return registry_status(self)

    # --- snapshot (journal compaction; see snapshot) -------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """A JSON-able image of everything, including remembered results of recent calls."""
        return snapshot.dump_state(self)

    def load_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`to_state` (on a fresh core with the same fleet and capacity)."""
        snapshot.load_state(self, state)
