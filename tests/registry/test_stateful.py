"""The registry against a small reference model, under every interleaving hypothesis finds.

Rules cover publication (reserve/ready/commit/abort/cleanup), rollback (to a RETIRED version in
one step; to a RECLAIMED one by a reload attempt that is prepared, committed, or aborted and
cleaned like any other), Sessions (bind with or without an
owner lease, close/release/forget), durable Session names, owner leases (open, renew, owner
restart with release or adopt, close, time passing, the expiry sweep), reclaim (claim/confirm),
engine restarts and repairs, registry restarts (journal replay, then the lease grace before the
first call, or at once when the host is started), the registry host's own background sweeper
(gated: it sweeps when a rule lets it, whatever this process opened), lost replies (apply, drop
the answer, replay later with the same request id) and duplicate delivery. Time is a fake clock
the machine moves. After every step the invariants of
the design are checked against the real registry, most of them without the model's help.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import NamedSession
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import from_wire
from agentic_lora.registry.types import new_request_id

from .util import FakeClock
from .util import SweepGate
from .util import digest_of

ENGINES = ("e0", "e1")
CAPACITY = 2
VERSION_IDS = ("v1", "v2", "v3", "v4", "v5", "v6")
CONTENTS = ("a", "b")
#: Session keys; open_named mints its keys from the same pool, so names and plain Sessions collide.
SESSIONS = ("s1", "s2", "s3", "s4", "s5", "s6")
NAMES = ("n1", "n2")
OWNERS = ("w", "g")
NAME_TTL = 15.0
DELIVERY = st.sampled_from(["once", "lost_reply", "duplicate"])
#: Which incarnation of an owner a call names: its latest, a brand new one, or the one before.
WHICH = st.sampled_from(["latest", "new", "older"])
LEASE_CHOICE = st.sampled_from([None, "live", *OWNERS])
HOLDS_SLOT = {"LOADING", "PUBLISHED", "RETIRED", "RECLAIMING", "ABORTED"}
HOLDS_REF = {"BOUND", "CLOSING"}
#: How far a lost reply's replay comes after the original call (fake seconds).
REPLAY_DELAY = 0.25
KEY_PICK = st.integers(0, 2 * len(SESSIONS) - 1)


@dataclass
class MVersion:
    content: str
    state: str = "LOADING"
    attempt: int = 1
    ready: dict[str, int] = field(default_factory=dict)
    cleaned: set[str] = field(default_factory=set)
    reclaimed: set[str] = field(default_factory=set)
    refs: int = 0
    committed_attempt: int | None = None


@dataclass
class MSession:
    state: str
    version: str | None
    lease: str | None


@dataclass
class MLease:
    owner: str
    incarnation: str
    ttl: float
    expires_at: float
    sessions: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)


@dataclass
class MName:
    key: str
    lease: str | None
    closed_at: float | None = None
    why: str | None = None


def lease_id(owner: str, n: int) -> str:
    return f"{owner}/i{n}"


class Model:
    """What the registry must do, written as plainly as possible."""

    def __init__(self) -> None:
        self.versions: dict[str, MVersion] = {}
        self.default: str | None = None
        self.revision = 0
        self.pending: str | None = None
        self.incarnation = dict.fromkeys(ENGINES, 0)
        self.known = dict.fromkeys(ENGINES, False)
        self.sessions: dict[str, MSession] = {}
        self.now = 0.0
        self.leases: dict[str, MLease] = {}
        self.owners: dict[str, str] = {}
        self.dead: dict[str, str] = {}
        self.issued = dict.fromkeys(OWNERS, 0)
        self.names: dict[str, MName] = {}
        self.name_of: dict[str, str] = {}
        #: Set by a registry restart with live leases: the next call first resumes them.
        self.resume_pending = False
        #: While the default is one a rollback brought back: the version it replaced.
        self.rolled_back_from: str | None = None

    def make_default(self, vid: str) -> None:
        """``vid`` becomes the default (a commit, or a rollback); a version committed before
        comes back by a rollback, and the model remembers where from."""
        v = self.versions[vid]
        rollback = v.committed_attempt is not None
        if self.default is not None:
            self.versions[self.default].state = "RETIRED"
        self.rolled_back_from = self.default if rollback else None
        v.state, v.committed_attempt = "PUBLISHED", v.attempt
        self.default, self.pending = vid, None
        self.revision += 1

    def cleaned_everywhere(self, vid: str) -> None:
        """Every engine confirmed the aborted attempt's cleanup: a reload of a version committed
        before is RECLAIMED again, anything else FAILED_CLEAN; the slot is free either way."""
        v = self.versions[vid]
        v.state = "RECLAIMED" if v.committed_attempt is not None else "FAILED_CLEAN"
        if self.pending == vid:
            self.pending = None

    def slots(self) -> int:
        return sum(1 for v in self.versions.values() if v.state in HOLDS_SLOT)

    def in_state(self, state: str) -> bool:
        return any(v.state == state for v in self.versions.values())

    def first_in(self, state: str) -> tuple[str, MVersion]:
        """The oldest version in ``state`` (a rule's precondition made sure there is one)."""
        return next((k, v) for k, v in self.versions.items() if v.state == state)

    def incarnation_of(self, owner: str, which: str) -> int:
        n = self.issued[owner]
        if which == "new":
            return n + 1
        if which == "older":
            return max(n - 1, 1)
        return max(n, 1)

    # --- time and leases ------------------------------------------------------------------------

    def tick(self, t: float) -> None:
        self.now = max(self.now, t)

    def resume(self, t: float) -> None:
        self.tick(t)
        for lease in self.leases.values():
            lease.expires_at = max(lease.expires_at, t + lease.ttl)

    def detach(self, key: str, s: MSession) -> None:
        if s.lease is not None and s.lease in self.leases:
            self.leases[s.lease].sessions.discard(key)

    def expire_session(self, key: str) -> bool:
        s = self.sessions.get(key)
        if s is None or s.state not in HOLDS_REF:
            return False
        if s.version is not None:
            self.versions[s.version].refs -= 1
        s.state = "EXPIRED"
        self.detach(key, s)
        return True

    def tombstone(self, name: str, why: str) -> None:
        rec = self.names.get(name)
        if rec is None or rec.closed_at is not None:
            return
        rec.closed_at, rec.why = self.now, why
        if rec.lease is not None and rec.lease in self.leases:
            self.leases[rec.lease].names.discard(name)

    def end_lease(self, lid: str, why: str) -> tuple[str, ...]:
        lease = self.leases[lid]
        released = tuple(k for k in sorted(lease.sessions) if self.expire_session(k))
        for name in sorted(lease.names):
            self.tombstone(name, why)
        del self.leases[lid]
        if self.owners.get(lease.owner) == lid:
            del self.owners[lease.owner]
        self.dead[lid] = why
        return released

    def name_refusal(self, rec: MName) -> str:
        return "SESSION_CLOSED" if rec.why == "closed" else "SESSION_EXPIRED"

    def sweep_due(self, t: float) -> bool:
        return any(lease.expires_at <= t for lease in self.leases.values()) or any(
            rec.closed_at is not None and rec.closed_at + NAME_TTL <= t
            for rec in self.names.values()
        )

    def sweep(self, t: float) -> SweepResult:
        self.tick(t)
        expired = sorted(lid for lid, lease in self.leases.items() if lease.expires_at <= t)
        sessions: list[str] = []
        for lid in expired:
            sessions.extend(self.end_lease(lid, "expired"))
        stale = [
            n
            for n, rec in self.names.items()
            if rec.closed_at is not None and rec.closed_at + NAME_TTL <= t
        ]
        for name in stale:
            rec = self.names.pop(name)
            if self.name_of.get(rec.key) == name:
                del self.name_of[rec.key]
        return SweepResult(tuple(expired), tuple(sessions), len(stale))

    def holds_deadlines(self) -> bool:
        return bool(self.leases) or bool(self.names)


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # The journal lives in memory-backed storage where there is some: this machine proves
        # replay, not the disk's fsync (test_journal does, on a real disk), and thousands of
        # fsyncs would dominate its run time.
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="lora-registry-", dir=where))
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(0.0)
        self.gate = SweepGate()
        #: Whether this registry's host was started or called since it was opened (the sweeper
        #: may run only then: nothing runs in a registry nobody uses).
        self.active = False
        self.reg = self._open()
        self.model = Model()
        #: Every version a Binding ever named per Session key (reset only when it is forgotten).
        self.bound_versions: dict[str, set[str]] = {}
        #: Names seen tombstoned, with their key: a tombstone never revives nor changes its key.
        self.tombstoned: dict[str, str] = {}
        #: Each version id's identity as first seen: a rollback never changes it.
        self.identities: dict[str, tuple[str, str]] = {}

    def _open(self) -> LocalRegistry:
        self.gate = SweepGate()  # a fresh gate: the old sweeper was cancelled with its registry
        self.active = False
        return LocalRegistry(
            engines=ENGINES,
            capacity=CAPACITY,
            journal_path=self.dir / "j.sqlite",
            compact_every=11,
            clock=self.clock,
            sweep_interval=1.0,  # real seconds never pass here: the gate alone wakes it
            sleep=self.gate.sleep,
            name_ttl=NAME_TTL,
        )

    def teardown(self) -> None:
        self.loop.run_until_complete(self.reg.aclose())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(publish_first=st.booleans())
    def start(self, publish_first: bool) -> None:
        """Half of the runs start with a published version, so Sessions bind from the first step
        (the other half also explore everything that happens before any publication)."""
        if publish_first:
            self._publish("a", "once")

    # --- delivery: once, lost reply (apply, drop, replay later), duplicate ----------------------

    def _begin(self) -> float:
        """Right before a call: if it is the first since a registry restart, the model takes the
        lease grace the registry runs before it. Returns the time the call carries."""
        m = self.model
        if m.resume_pending:
            m.resume_pending = False
            m.resume(self.clock.t)
        return self.clock.t

    def _do(self, delivery: str, verb: str, **args: Any) -> Any:
        rid = new_request_id()
        default_before = self.reg.core.default_version
        first = self._attempt(verb, rid, args)
        if delivery != "once":
            if delivery == "lost_reply":
                # The replay comes later: ``now`` is not part of the idempotency fingerprint.
                self.clock.t += REPLAY_DELAY
            second = self._attempt(verb, rid, args)
            if isinstance(first, AgenticLoRAError):
                assert isinstance(second, AgenticLoRAError)
                assert second.code == first.code
            else:
                assert second == first, (verb, first, second)
        if verb not in ("commit", "rollback"):
            # The default changes only at a commit or a rollback.
            assert self.reg.core.default_version == default_before
        binding = first.binding if isinstance(first, NamedSession) else first
        if isinstance(binding, Binding):
            self.bound_versions.setdefault(binding.session_key, set()).add(binding.version_id)
        return first

    def _attempt(self, verb: str, rid: str, args: dict[str, Any]) -> Any:
        self.active = True
        try:
            return self.loop.run_until_complete(getattr(self.reg, verb)(request_id=rid, **args))
        except AgenticLoRAError as exc:
            return exc

    @staticmethod
    def _expect(result: Any, code: str | None) -> bool:
        """Check the outcome's error code (None = success); True when it succeeded."""
        if code is None:
            assert not isinstance(result, AgenticLoRAError), result
            return True
        assert isinstance(result, AgenticLoRAError), (code, result)
        assert result.code == code, (code, result)
        return False

    def _lease_arg(self, choice: str | None) -> str | None:
        """None; the first live lease ("live", None if there is none); or the lease id of an
        owner's latest incarnation (live, dead or never granted)."""
        if choice is None:
            return None
        if choice == "live":
            return min(self.model.leases, default=None)
        return lease_id(choice, self.model.incarnation_of(choice, "latest"))

    # --- publication ---------------------------------------------------------------------------

    @rule(
        version_id=st.sampled_from(VERSION_IDS),
        content=st.sampled_from(CONTENTS),
        delivery=DELIVERY,
    )
    def reserve(self, version_id: str, content: str, delivery: str) -> None:
        self._begin()
        m = self.model
        v = m.versions.get(version_id)
        admit = (
            "PUBLICATION_BLOCKED"
            if m.pending
            else ("CAPACITY_ERROR" if m.slots() >= CAPACITY else None)
        )
        if v is None:
            code = admit
        elif v.content != content:
            code = "VERSION_CONFLICT"
        elif v.state == "ABORTED" or (v.state == "LOADING" and v.committed_attempt is not None):
            code = "PUBLICATION_BLOCKED"  # aborted and uncleaned, or a rollback's reload
        elif v.state == "FAILED_CLEAN":
            code = admit
        else:
            code = None
        result = self._do(delivery, "reserve", version_id=version_id, digest=digest_of(content))
        if not self._expect(result, code):
            return
        if v is None:
            m.versions[version_id] = MVersion(content)
            m.pending = version_id
            assert result.outcome == "STARTED"
        elif v.state == "FAILED_CLEAN":
            v.state, v.attempt, v.ready, v.cleaned = "LOADING", v.attempt + 1, {}, set()
            m.pending = version_id
            assert result.outcome == "RETRY_STARTED"
        elif v.state == "LOADING":
            assert result.outcome == "IN_PROGRESS"
        else:
            assert result.outcome == "ALREADY_COMPLETED"
        assert result.attempt == m.versions[version_id].attempt

    @precondition(
        lambda self: (
            self.model.pending is None
            and self.model.slots() < CAPACITY
            and any(v not in self.model.versions for v in VERSION_IDS)
        )
    )
    @rule(content=st.sampled_from(CONTENTS), delivery=DELIVERY)
    def publish(self, content: str, delivery: str) -> None:
        """reserve, READY from every engine, commit: one whole publication in one step, so that
        Sessions, leases and reclaim meet published versions often (the fine-grained rules above
        cover the interleavings inside a publication)."""
        self._publish(content, delivery)

    def _publish(self, content: str, delivery: str) -> None:
        self._begin()
        m = self.model
        vid = next(v for v in VERSION_IDS if v not in m.versions)
        r = self._do(delivery, "reserve", version_id=vid, digest=digest_of(content))
        self._expect(r, None)
        assert (r.outcome, r.attempt) == ("STARTED", 1)
        v = m.versions[vid] = MVersion(content)
        m.pending = vid
        for engine in ENGINES:
            inc = m.incarnation[engine]
            result = self._do(delivery, "record_ready", receipt=self._receipt(vid, engine, 1, inc))
            self._expect(result, None)
            v.ready[engine] = inc
            m.known[engine] = True
        result = self._do(
            delivery, "commit", version_id=vid, attempt=1, expected_default_revision=m.revision
        )
        self._expect(result, None)
        m.make_default(vid)
        assert result.default_revision == m.revision

    def _receipt(
        self, version_id: str, engine: str, attempt: int, incarnation: int
    ) -> ReadyReceipt:
        v = self.reg.core.version(version_id)
        ref = VersionRef(version_id, v.digest, v.lora_name, attempt)
        return ReadyReceipt(engine, ref, f"inc-{incarnation}")

    @precondition(lambda self: self.model.pending is not None)
    @rule(engine=st.sampled_from(ENGINES), stale=st.booleans(), delivery=DELIVERY)
    def ready(self, engine: str, stale: bool, delivery: str) -> None:
        self._begin()
        m = self.model
        assert m.pending is not None
        v = m.versions[m.pending]
        attempt = v.attempt - 1 if stale and v.attempt > 1 else v.attempt
        inc = m.incarnation[engine]
        if v.state != "LOADING" and attempt == v.committed_attempt:
            code = None  # an aborted reload: the committed attempt's READY is a late duplicate
        elif v.state != "LOADING":
            code = "STALE_ATTEMPT" if attempt < v.attempt else "INVALID_STATE"
        elif attempt != v.attempt:
            code = "STALE_ATTEMPT"
        else:
            code = None
        result = self._do(
            delivery, "record_ready", receipt=self._receipt(m.pending, engine, attempt, inc)
        )
        if self._expect(result, code) and v.state == "LOADING":
            v.ready[engine] = inc
            m.known[engine] = True

    @precondition(lambda self: self.model.pending is not None)
    @rule(delivery=DELIVERY, stale_revision=st.booleans())
    def commit(self, delivery: str, stale_revision: bool) -> None:
        self._begin()
        m = self.model
        vid = m.pending
        assert vid is not None
        v = m.versions[vid]
        revision = m.revision - 1 if stale_revision and m.revision > 0 else m.revision
        if v.state != "LOADING":
            code = "INVALID_STATE"
        elif revision != m.revision:
            code = "REVISION_CONFLICT"
        elif any(v.ready.get(e) != m.incarnation[e] for e in ENGINES):
            code = "NOT_READY"
        else:
            code = None
        before = self.reg.core.default_version
        result = self._do(
            delivery,
            "commit",
            version_id=vid,
            attempt=v.attempt,
            expected_default_revision=revision,
        )
        if not self._expect(result, code):
            assert self.reg.core.default_version == before
            return
        rollback, previous = v.committed_attempt is not None, m.default
        m.make_default(vid)
        assert result.default_revision == m.revision
        # The commit of a reload is the rollback; a first publication's is not.
        assert (result.rollback, result.previous_default) == (rollback, previous)

    @precondition(lambda self: self.model.pending is not None)
    @rule(delivery=DELIVERY)
    def abort(self, delivery: str) -> None:
        self._begin()
        m = self.model
        vid = m.pending
        assert vid is not None
        v = m.versions[vid]
        result = self._do(delivery, "abort", version_id=vid, attempt=v.attempt, reason="test")
        self._expect(result, None)
        v.state, v.ready = "ABORTED", {}

    @precondition(lambda self: self.model.in_state("ABORTED"))
    @rule(engine=st.sampled_from(ENGINES), delivery=DELIVERY)
    def confirm_cleanup(self, engine: str, delivery: str) -> None:
        self._begin()
        vid, v = self.model.first_in("ABORTED")
        result = self._do(
            delivery, "confirm_cleanup", version_id=vid, attempt=v.attempt, engine=engine
        )
        self._expect(result, None)
        v.cleaned.add(engine)
        if v.cleaned == set(ENGINES):
            self.model.cleaned_everywhere(vid)

    @rule(engine=st.sampled_from(ENGINES), delivery=DELIVERY)
    def engine_restart(self, engine: str, delivery: str) -> None:
        self._begin()
        m = self.model
        m.incarnation[engine] += 1
        result = self._do(
            delivery,
            "observe_incarnation",
            engine=engine,
            incarnation=f"inc-{m.incarnation[engine]}",
        )
        self._expect(result, None)
        assert result is True
        first_sighting = not m.known[engine]
        m.known[engine] = True
        if first_sighting:
            return
        # A new process holds nothing: what was recorded against the old one is void.
        for vid, v in m.versions.items():
            if v.state in ("LOADING", "PUBLISHED", "RETIRED"):
                if v.ready.get(engine) not in (None, m.incarnation[engine]):
                    del v.ready[engine]
            elif v.state == "ABORTED":  # the restart proves the cleanup
                v.cleaned.add(engine)
                if v.cleaned == set(ENGINES):
                    m.cleaned_everywhere(vid)
            elif v.state == "RECLAIMING":  # nothing reloads a reclaiming version
                v.reclaimed.add(engine)
                if v.reclaimed == set(ENGINES):
                    v.state = "RECLAIMED"

    @precondition(
        lambda self: any(v.committed_attempt is not None for v in self.model.versions.values())
    )
    @rule(
        pick=st.integers(0, len(VERSION_IDS) - 1),
        engine=st.sampled_from(ENGINES),
        stale=st.booleans(),
        delivery=DELIVERY,
    )
    def engine_repair(self, pick: int, engine: str, stale: bool, delivery: str) -> None:
        """The committed attempt's READY again (the version was reloaded onto the engine)."""
        self._begin()
        m = self.model
        committed = [k for k, v in m.versions.items() if v.committed_attempt is not None]
        vid = committed[pick % len(committed)]
        v = m.versions[vid]
        assert v.committed_attempt is not None
        current = m.incarnation[engine]
        inc = current - 1 if stale and current > 0 else current
        if v.state in ("PUBLISHED", "RETIRED"):
            code = "ENGINE_RESTARTED" if inc != current else None
        elif v.state == "LOADING":
            code = "STALE_ATTEMPT"  # a rollback reloads it: the reclaimed attempt is superseded
        else:
            code = None  # RECLAIMING/RECLAIMED/ABORTED: a late duplicate, nothing changes
        result = self._do(
            delivery,
            "record_ready",
            receipt=self._receipt(vid, engine, v.committed_attempt, inc),
        )
        if self._expect(result, code) and v.state in ("PUBLISHED", "RETIRED"):
            v.ready[engine] = inc

    # --- rollback ------------------------------------------------------------------------------

    def _rollback_target(self, pick: int) -> str:
        """A version id; small picks land on versions a rollback may reach (RETIRED, RECLAIMED)."""
        m = self.model
        likely = [k for k, v in m.versions.items() if v.state in ("RETIRED", "RECLAIMED")]
        candidates = [*likely, *m.versions, "v-unknown"]
        return candidates[pick % len(candidates)]

    def _rollback_refusal(self, vid: str) -> str | None:
        """The refusal every rollback verb shares, or None."""
        m = self.model
        v = m.versions.get(vid)
        if v is None:
            return "UNKNOWN_VERSION"
        if v.state == "ABORTED" or v.committed_attempt is None or m.default == vid:
            return "ROLLBACK_REFUSED"
        if m.pending is not None and m.pending != vid:
            return "PUBLICATION_BLOCKED"
        return None

    @rule(
        pick=st.integers(0, 2 * len(VERSION_IDS)),
        stale=st.booleans(),
        stale_revision=st.booleans(),
        delivery=DELIVERY,
    )
    def rollback(self, pick: int, stale: bool, stale_revision: bool, delivery: str) -> None:
        """Make a RETIRED version the default again, in one step, once every engine holds it."""
        self._begin()
        m = self.model
        vid = self._rollback_target(pick)
        v = m.versions.get(vid)
        attempt = (v.attempt - 1 if stale and v.attempt > 1 else v.attempt) if v else 1
        revision = m.revision - 1 if stale_revision and m.revision > 0 else m.revision
        by_rollback = v is not None and m.default == vid and m.rolled_back_from is not None
        if by_rollback:
            # Still the default that rollback made it: the same receipt back, nothing moves.
            code = None if attempt == v.attempt else "ROLLBACK_REFUSED"  # type: ignore[union-attr]
        elif (code := self._rollback_refusal(vid)) is not None:
            pass
        elif v is None or v.state != "RETIRED":
            code = "INVALID_STATE"
        elif attempt != v.attempt:
            code = "STALE_ATTEMPT"
        elif revision != m.revision:
            code = "REVISION_CONFLICT"
        elif any(v.ready.get(e) != m.incarnation[e] for e in ENGINES):
            code = "NOT_READY"
        revision_before = m.revision
        result = self._do(
            delivery,
            "rollback",
            version_id=vid,
            attempt=attempt,
            expected_default_revision=revision,
        )
        if not self._expect(result, code):
            return
        if by_rollback:
            assert result.default_revision == revision_before
        else:
            previous = m.default
            m.make_default(vid)
            assert (result.default_revision, result.previous_default) == (m.revision, previous)
        assert result.rollback
        assert self.reg.core.status().rolled_back_from == m.rolled_back_from is not None

    @rule(pick=st.integers(0, 2 * len(VERSION_IDS)), delivery=DELIVERY)
    def reserve_rollback(self, pick: int, delivery: str) -> None:
        """Start a rollback to a RECLAIMED version: a new attempt of the same content, its slot
        admitted first (the attempt is then prepared, committed or aborted by the rules above)."""
        self._reserve_rollback(self._rollback_target(pick), delivery)

    def _reserve_rollback(self, vid: str, delivery: str) -> None:
        self._begin()
        m = self.model
        v = m.versions.get(vid)
        code = self._rollback_refusal(vid)
        if code is None:
            assert v is not None
            if v.state == "LOADING":
                code = None  # its reload is running: joined
            elif v.state != "RECLAIMED":
                code = "INVALID_STATE"
            elif m.slots() >= CAPACITY:
                code = "CAPACITY_ERROR"
        result = self._do(delivery, "reserve_rollback", version_id=vid)
        if not self._expect(result, code):
            return
        assert v is not None
        if v.state == "LOADING":
            assert result.outcome == "IN_PROGRESS"
        else:
            v.state, v.attempt, v.ready, v.cleaned = "LOADING", v.attempt + 1, {}, set()
            v.reclaimed = set()
            m.pending = vid
            assert result.outcome == "RELOAD_STARTED"
        assert result.attempt == v.attempt

    @precondition(lambda self: self.model.in_state("RETIRED") and self.model.pending is None)
    @rule(delivery=DELIVERY)
    def rollback_to_a_retired_version(self, delivery: str) -> None:
        """What a rollback's driver does for a RETIRED version, in one step: load it back (the
        committed attempt's READY) onto every engine that restarted since, then roll back."""
        m = self.model
        vid, v = m.first_in("RETIRED")
        for engine in ENGINES:
            inc = m.incarnation[engine]
            if v.ready.get(engine) != inc:
                assert v.committed_attempt is not None
                self._begin()
                receipt = self._receipt(vid, engine, v.committed_attempt, inc)
                self._expect(self._do(delivery, "record_ready", receipt=receipt), None)
                v.ready[engine] = inc
                m.known[engine] = True
        self._begin()
        self._rolled_back(vid, "rollback", delivery)

    @precondition(lambda self: self.model.in_state("RETIRED"))
    @rule(delivery=DELIVERY)
    def drain_and_reclaim(self, delivery: str) -> None:
        """The oldest RETIRED version's Sessions close, it is claimed and every engine confirms:
        RECLAIMED, the state a rollback reloads from."""
        m = self.model
        vid = next(k for k, v in m.versions.items() if v.state == "RETIRED")
        self.drain_and_claim(delivery)
        if m.versions[vid].state == "RECLAIMING":
            for engine in ENGINES:
                self.confirm_reclaim(engine, delivery)

    @precondition(
        lambda self: (
            self.model.in_state("RECLAIMED")
            and self.model.pending is None
            and self.model.slots() < CAPACITY
        )
    )
    @rule(clean=st.booleans(), delivery=DELIVERY)
    def a_reload_fails(self, clean: bool, delivery: str) -> None:
        """A rollback's reload is aborted (an engine refused it), and with ``clean`` every engine
        confirms its cleanup: the version is RECLAIMED again, never FAILED_CLEAN (else its cleanup
        is left to the fine-grained rules, engine restarts included)."""
        m = self.model
        vid, v = m.first_in("RECLAIMED")
        self._reserve_rollback(vid, delivery)
        assert (v.state, m.pending) == ("LOADING", vid)
        self.abort(delivery)
        if clean:
            for engine in ENGINES:
                self.confirm_cleanup(engine, delivery)
            assert v.state == "RECLAIMED"

    @precondition(lambda self: self.model.in_state("RECLAIMED") and self.model.pending is None)
    @rule(delivery=DELIVERY)
    def rollback_to_a_reclaimed_version(self, delivery: str) -> None:
        """reserve_rollback, READY from every engine, commit: a whole reload in one step, so that
        rolled-back versions meet Sessions, reclaim and restarts often (the fine-grained rules
        cover the interleavings inside it)."""
        m = self.model
        if m.slots() >= CAPACITY:
            return
        vid, v = m.first_in("RECLAIMED")
        self._begin()
        r = self._do(delivery, "reserve_rollback", version_id=vid)
        self._expect(r, None)
        v.state, v.attempt, v.ready, v.cleaned = "LOADING", v.attempt + 1, {}, set()
        v.reclaimed = set()
        m.pending = vid
        for engine in ENGINES:
            inc = m.incarnation[engine]
            receipt = self._receipt(vid, engine, v.attempt, inc)
            self._expect(self._do(delivery, "record_ready", receipt=receipt), None)
            v.ready[engine] = inc
            m.known[engine] = True
        self._rolled_back(vid, "commit", delivery)

    def _rolled_back(self, vid: str, verb: str, delivery: str) -> None:
        """``verb`` (``rollback``, or ``commit`` of a reload) makes ``vid`` the default again."""
        m = self.model
        previous = m.default
        result = self._do(
            delivery,
            verb,
            version_id=vid,
            attempt=m.versions[vid].attempt,
            expected_default_revision=m.revision,
        )
        self._expect(result, None)
        m.make_default(vid)
        assert (result.rollback, result.previous_default) == (True, previous)

    # --- Sessions ------------------------------------------------------------------------------

    @rule(session=st.sampled_from(SESSIONS), lease=LEASE_CHOICE, delivery=DELIVERY)
    def bind(self, session: str, lease: str | None, delivery: str) -> None:
        self._bind(session, self._lease_arg(lease), delivery)

    def _fresh_keys(self) -> list[str]:
        m = self.model
        return [k for k in SESSIONS if k not in m.sessions and k not in m.name_of]

    @precondition(
        lambda self: self.model.default is not None and self.model.leases and self._fresh_keys()
    )
    @rule(lease_pick=st.integers(0, 3), key_pick=st.integers(0, 5), delivery=DELIVERY)
    def bind_under_live_lease(self, lease_pick: int, key_pick: int, delivery: str) -> None:
        """A new Session bound under a live lease: what every owner event acts on."""
        live = sorted(self.model.leases)
        fresh = self._fresh_keys()
        self._bind(fresh[key_pick % len(fresh)], live[lease_pick % len(live)], delivery)

    def _bind(self, session: str, lid: str | None, delivery: str) -> None:
        self._begin()
        m = self.model
        s = m.sessions.get(session)
        name = m.name_of.get(session)
        under = lid
        if s is not None:
            code = {"BOUND": None, "EXPIRED": "SESSION_EXPIRED"}.get(s.state, "SESSION_CLOSED")
        elif name is not None and m.names[name].closed_at is not None:
            code = m.name_refusal(m.names[name])
        else:
            if name is not None:
                under = m.names[name].lease  # a named Session binds under its name's lease
            if under is not None and under not in m.leases:
                code = "LEASE_EXPIRED"
            else:
                code = None if m.default is not None else "NO_PUBLISHED_VERSION"
        args: dict[str, Any] = {"session_key": session}
        if lid is not None:
            args["lease"] = lid
        result = self._do(delivery, "bind_first", **args)
        if not self._expect(result, code):
            return
        if s is None:
            assert m.default is not None
            m.sessions[session] = MSession("BOUND", m.default, under)
            m.versions[m.default].refs += 1
            if under is not None:
                m.leases[under].sessions.add(session)
            assert result.version_id == m.default
            assert (result.default_revision, result.rolled_back_from) == (
                m.revision,
                m.rolled_back_from,
            )
        else:
            assert result.version_id == s.version  # bound at most once: the first answer forever

    def _key(self, pick: int, *states: str) -> str:
        """A Session key; small picks (hypothesis favours them) land on keys in ``states``."""
        m = self.model
        preferred = [k for k in SESSIONS if k in m.sessions and m.sessions[k].state in states]
        candidates = [*preferred, *SESSIONS]
        return candidates[pick % len(candidates)]

    @rule(pick=KEY_PICK, delivery=DELIVERY)
    def begin_close(self, pick: int, delivery: str) -> None:
        self._begin_close(self._key(pick, "BOUND"), delivery)

    def _begin_close(self, session: str, delivery: str) -> None:
        t = self._begin()
        m = self.model
        result = self._do(delivery, "begin_close", session_key=session)
        self._expect(result, None)
        m.tick(t)  # begin_close is timed: it dates the name's tombstone itself
        s = m.sessions.get(session)
        if s is None:
            m.sessions[session] = MSession("CLOSING", None, None)
        elif s.state == "BOUND":
            s.state = "CLOSING"
        if session in m.name_of:
            m.tombstone(m.name_of[session], "closed")
        assert result.state.value == m.sessions[session].state

    @rule(pick=KEY_PICK, delivery=DELIVERY)
    def release(self, pick: int, delivery: str) -> None:
        # EXPIRED first: a CLOSING Session left unreleased a while meets its lease's end more often.
        self._release(self._key(pick, "EXPIRED"), delivery)

    def _release(self, session: str, delivery: str) -> None:
        self._begin()
        m = self.model
        s = m.sessions.get(session)
        code = (
            None
            if s is not None and s.state in ("CLOSING", "CLOSED", "EXPIRED")
            else "INVALID_STATE"
        )
        result = self._do(delivery, "release", session_key=session)
        if not self._expect(result, code):
            return
        assert s is not None
        assert result.released_now == (s.state == "CLOSING")
        assert result.version_id == s.version
        if s.state == "CLOSING":
            s.state = "CLOSED"
            if s.version is not None:
                m.versions[s.version].refs -= 1  # released at most once
            m.detach(session, s)

    @rule(pick=KEY_PICK, delivery=DELIVERY)
    def forget(self, pick: int, delivery: str) -> None:
        self._begin()
        m = self.model
        session = self._key(pick, "CLOSED", "EXPIRED")
        s = m.sessions.get(session)
        code = None if s is None or s.state not in HOLDS_REF else "SESSION_STILL_BOUND"
        result = self._do(delivery, "forget_sessions", session_keys=[session])
        if self._expect(result, code):
            assert result == (0 if s is None else 1)
            m.sessions.pop(session, None)
            # The key may start a new lifecycle now (unless a name tombstone still holds it).
            self.bound_versions.pop(session, None)

    # --- durable Session names -----------------------------------------------------------------

    @precondition(
        lambda self: (
            self.model.default is not None
            and any(
                rec.closed_at is None and rec.key not in self.model.sessions
                for rec in self.model.names.values()
            )
        )
    )
    @rule(lease=LEASE_CHOICE, delivery=DELIVERY)
    def bind_named(self, lease: str | None, delivery: str) -> None:
        """The first generation of a named Session (whatever lease the caller passes)."""
        m = self.model
        key = next(
            rec.key
            for _, rec in sorted(m.names.items())
            if rec.closed_at is None and rec.key not in m.sessions
        )
        self._bind(key, self._lease_arg(lease), delivery)

    @rule(name=st.sampled_from(NAMES), pick=KEY_PICK, lease=LEASE_CHOICE, delivery=DELIVERY)
    def open_named(self, name: str, pick: int, lease: str | None, delivery: str) -> None:
        t = self._begin()
        m = self.model
        fresh = self._fresh_keys()
        key = [*fresh, *SESSIONS][pick % (len(fresh) + len(SESSIONS))]
        lid = self._lease_arg(lease)
        rec = m.names.get(name)
        if lid is not None and lid not in m.leases:
            code: str | None = "LEASE_EXPIRED"
        elif rec is not None:
            code = m.name_refusal(rec) if rec.closed_at is not None else None
        elif key in m.sessions or key in m.name_of:
            code = "INVALID_STATE"
        else:
            code = None
        result = self._do(delivery, "open_named", name=name, session_key=key, lease=lid)
        if not self._expect(result, code):
            return
        m.tick(t)
        if rec is None:
            m.names[name] = MName(key, lid)
            m.name_of[key] = name
            if lid is not None:
                m.leases[lid].names.add(name)
            assert result == NamedSession(name, key, lid, None, adopted=False)
            return
        adopted = rec.lease != lid
        if adopted:
            if rec.lease is not None and rec.lease in m.leases:
                m.leases[rec.lease].names.discard(name)
                m.leases[rec.lease].sessions.discard(rec.key)
            rec.lease = lid
            if lid is not None:
                m.leases[lid].names.add(name)
            s = m.sessions.get(rec.key)
            if s is not None:
                s.lease = lid
                if lid is not None and s.state in HOLDS_REF:
                    m.leases[lid].sessions.add(rec.key)
        s = m.sessions.get(rec.key)
        assert (result.session_key, result.lease, result.adopted) == (rec.key, lid, adopted)
        assert (result.binding.version_id if result.binding else None) == (
            s.version if s is not None else None
        )

    # --- owner leases and time -----------------------------------------------------------------

    def _open_lease(
        self, owner: str, which: str, ttl: float, on_restart: str, delivery: str
    ) -> None:
        t = self._begin()
        m = self.model
        n = m.incarnation_of(owner, which)
        lid = lease_id(owner, n)
        code = "LEASE_EXPIRED" if lid in m.dead else None
        result = self._do(
            delivery,
            "open_lease",
            owner=owner,
            incarnation=f"i{n}",
            ttl=ttl,
            on_restart=on_restart,
        )
        if not self._expect(result, code):
            return
        m.tick(t)
        m.issued[owner] = max(m.issued[owner], n)
        released: tuple[str, ...] = ()
        adopted: tuple[str, ...] = ()
        if lid in m.leases:  # the same incarnation again: a renewal with this TTL
            lease = m.leases[lid]
            lease.ttl, lease.expires_at = ttl, t + ttl
        else:
            lease = MLease(owner, f"i{n}", ttl, t + ttl)
            previous = m.owners.get(owner)
            if previous is not None:
                old = m.leases[previous]
                if on_restart == "adopt":
                    adopted = tuple(sorted(old.sessions))
                    for key in old.sessions:
                        m.sessions[key].lease = lid
                    for name in old.names:
                        m.names[name].lease = lid
                    lease.sessions, lease.names = old.sessions, old.names
                    old.sessions, old.names = set(), set()
                released = m.end_lease(previous, "owner_restarted")
            m.leases[lid] = lease
            m.owners[owner] = lid
        assert result == LeaseGrant(
            lid, owner, f"i{n}", ttl, lease.expires_at, released=released, adopted=adopted
        )

    @rule(
        owner=st.sampled_from(OWNERS),
        which=WHICH,
        ttl=st.sampled_from([4.0, 10.0]),
        on_restart=st.sampled_from(["release", "adopt"]),
        delivery=DELIVERY,
    )
    def open_lease(
        self, owner: str, which: str, ttl: float, on_restart: str, delivery: str
    ) -> None:
        self._open_lease(owner, which, ttl, on_restart, delivery)

    @rule(
        owner=st.sampled_from(OWNERS),
        on_restart=st.sampled_from(["release", "adopt"]),
        delivery=DELIVERY,
    )
    def owner_restart(self, owner: str, on_restart: str, delivery: str) -> None:
        """A new incarnation of the owner (a rollout worker or gateway process came back)."""
        self._open_lease(owner, "new", 10.0, on_restart, delivery)

    @rule(owner=st.sampled_from(OWNERS), which=WHICH, delivery=DELIVERY)
    def renew(self, owner: str, which: str, delivery: str) -> None:
        t = self._begin()
        m = self.model
        n = m.incarnation_of(owner, which)
        lid = lease_id(owner, n)
        code = None if lid in m.leases else "LEASE_EXPIRED"
        result = self._do(delivery, "renew_lease", owner=owner, incarnation=f"i{n}")
        if not self._expect(result, code):
            if lid in m.dead:
                assert result.details["reason"] == m.dead[lid]
            return
        m.tick(t)
        lease = m.leases[lid]
        lease.expires_at = t + lease.ttl
        assert (result.lease_id, result.expires_at) == (lid, lease.expires_at)

    @rule(owner=st.sampled_from(OWNERS), which=WHICH, delivery=DELIVERY)
    def close_lease(self, owner: str, which: str, delivery: str) -> None:
        self._begin()
        m = self.model
        n = m.incarnation_of(owner, which)
        lid = lease_id(owner, n)
        result = self._do(delivery, "close_lease", owner=owner, incarnation=f"i{n}")
        self._expect(result, None)
        expected = m.end_lease(lid, "owner_closed") if lid in m.leases else ()
        assert tuple(result) == expected

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0, 12.0, None]))
    def time_passes(self, dt: float | None) -> None:
        """The fake clock moves on; None jumps exactly to the next lease or name deadline (the
        boundary, where ``<=`` against ``<`` decides)."""
        if dt is None:
            m = self.model
            deadlines = [lz.expires_at for lz in m.leases.values()] + [
                rec.closed_at + NAME_TTL for rec in m.names.values() if rec.closed_at is not None
            ]
            later = [d for d in deadlines if d > self.clock.t]
            self.clock.t = min(later) if later else self.clock.t + 1.0
        else:
            self.clock.t += dt

    @precondition(
        lambda self: (
            self.model.leases or any(rec.closed_at is not None for rec in self.model.names.values())
        )
    )
    @rule(delivery=DELIVERY)
    def sweep_at_the_next_deadline(self, delivery: str) -> None:
        """Time moves exactly to the next lease or name deadline and the sweep runs right then:
        the boundary, where ``<=`` against ``<`` decides."""
        self.time_passes(None)
        self.sweep(delivery)

    @rule(delivery=DELIVERY)
    def sweep(self, delivery: str) -> None:
        t = self._begin()
        result = self._do(delivery, "sweep", name_ttl=NAME_TTL)
        self._expect(result, None)
        assert result == self.model.sweep(t)

    @precondition(lambda self: self.reg.sweeping and self.model.leases)
    @rule()
    def the_host_sweeps_at_the_next_deadline(self) -> None:
        """Time moves to the next deadline and the host's sweeper runs right then (whether the
        lease was opened before the last restart or after it)."""
        self.time_passes(None)
        self.the_host_sweeps()

    @precondition(lambda self: self.reg.sweeping)
    @rule()
    def the_host_sweeps(self) -> None:
        """One round of the registry host's own background sweeper at the current time: it
        expires every lease the registry holds, whoever opened it and whether or not anything
        was opened since the last restart."""
        t = self._begin()
        m = self.model
        due = m.sweep_due(t)
        seq = self.reg.core.seq
        self.loop.run_until_complete(self.gate.round())
        if due:
            m.sweep(t)
        assert self.reg.core.seq == seq + (1 if due else 0)  # a sweep is journaled only when due

    # --- reclaim -------------------------------------------------------------------------------

    @rule(pick=st.integers(0, 2 * len(VERSION_IDS)), delivery=DELIVERY)
    def claim_reclaim(self, pick: int, delivery: str) -> None:
        m = self.model
        # Small picks (hypothesis favours them) land on versions that may be reclaimed.
        free = [k for k, v in m.versions.items() if v.state == "RETIRED" and v.refs == 0]
        candidates = [*free, *m.versions, "v-unknown"]
        self._claim(candidates[pick % len(candidates)], delivery)

    @precondition(lambda self: any(v.state == "RETIRED" for v in self.model.versions.values()))
    @rule(delivery=DELIVERY)
    def drain_and_claim(self, delivery: str) -> None:
        """What the reclaimer waits for, in one step: every Session still holding the oldest
        RETIRED version closes and releases, then the version is claimed (engine restarts and
        confirmations interleave with the RECLAIMING state that follows)."""
        m = self.model
        vid = next(k for k, v in m.versions.items() if v.state == "RETIRED")
        for key in SESSIONS:
            s = m.sessions.get(key)
            if s is not None and s.version == vid and s.state in HOLDS_REF:
                self._begin_close(key, delivery)
                self._release(key, delivery)
        self._claim(vid, delivery)

    def _claim(self, version_id: str, delivery: str) -> None:
        self._begin()
        m = self.model
        v = m.versions.get(version_id)
        if v is None:
            code = "UNKNOWN_VERSION"
        elif v.state in ("RECLAIMING", "RECLAIMED"):
            code = None
        elif v.state == "RETIRED":
            code = "SESSION_STILL_BOUND" if v.refs > 0 else None
        else:
            code = "INVALID_STATE"
        result = self._do(delivery, "claim_reclaim", version_id=version_id)
        if self._expect(result, code):
            assert v is not None
            if v.state == "RETIRED":
                v.state = "RECLAIMING"

    @precondition(lambda self: self.model.in_state("RECLAIMING"))
    @rule(engine=st.sampled_from(ENGINES), delivery=DELIVERY)
    def confirm_reclaim(self, engine: str, delivery: str) -> None:
        self._begin()
        vid, v = self.model.first_in("RECLAIMING")
        reclaim_id = self.reg.core.version(vid).reclaim_id
        assert reclaim_id is not None
        result = self._do(
            delivery, "confirm_reclaim", version_id=vid, reclaim_id=reclaim_id, engine=engine
        )
        self._expect(result, None)
        v.reclaimed.add(engine)
        if v.reclaimed == set(ENGINES):
            v.state = "RECLAIMED"

    # --- the registry itself restarts ----------------------------------------------------------

    @rule(downtime=st.sampled_from([0.0, 30.0]), start=st.booleans())
    def registry_restart(self, downtime: float, start: bool) -> None:
        """The registry host restarts on its journal. With ``start`` its process takes up the
        host's duties at once (a Deployment starts it); else only at its first call. Either way
        it never opens a lease of its own: the leases it sweeps are the ones it replayed."""
        before = self.reg.core.to_state()
        self.loop.run_until_complete(self.reg.aclose())
        self.clock.t += downtime  # owners could not renew meanwhile
        self.reg = self._open()
        # The journal rebuilds everything exactly, clock included; nothing has run yet.
        assert self.reg.core.to_state() == before
        assert not self.reg.sweeping
        self.model.resume_pending = bool(self.model.leases)
        if start:
            self._begin()  # the lease grace runs now, not at the first call
            self.loop.run_until_complete(self.reg.start())
            self.active = True
            assert self.reg.sweeping

    # --- invariants ----------------------------------------------------------------------------

    def _image(self) -> dict[str, Any]:
        return self.reg.core.to_state()

    @invariant()
    def matches_the_model(self) -> None:
        m = self.model
        core = self.reg.core
        st_ = core.status()
        assert st_.default_version == m.default
        assert st_.default_revision == m.revision
        assert st_.pending_version == m.pending
        assert st_.rolled_back_from == m.rolled_back_from
        assert st_.slots_in_use == m.slots() <= CAPACITY
        for vid, v in m.versions.items():
            got = core.version(vid)
            assert got.state.value == v.state, (vid, got, v)
            assert got.session_refs == v.refs
            assert got.attempt == v.attempt
            assert set(got.ready_engines) == set(v.ready), (vid, got, v)
        for key in SESSIONS:
            got_s = core.session(key)
            want = m.sessions.get(key)
            if want is None:
                assert got_s is None, (key, got_s)
            else:
                assert got_s is not None, key
                assert (got_s.state.value, got_s.version_id, got_s.lease) == (
                    want.state,
                    want.version,
                    want.lease,
                ), (key, got_s, want)
        image = self._image()
        assert image["now"] == m.now
        assert {
            lid: (owner, inc, ttl, exp, set(sessions), set(names))
            for owner, inc, ttl, exp, sessions, names in image["leases"]
            for lid in [f"{owner}/{inc}"]
        } == {
            lid: (lz.owner, lz.incarnation, lz.ttl, lz.expires_at, lz.sessions, lz.names)
            for lid, lz in m.leases.items()
        }
        assert image["owners"] == m.owners
        assert dict(image["dead_leases"]) == m.dead
        assert {n: (k, lz, at, why) for n, k, lz, at, why in image["names"]} == {
            n: (r.key, r.lease, r.closed_at, r.why) for n, r in m.names.items()
        }

    @invariant()
    def refs_are_exactly_the_sessions_that_hold_them(self) -> None:
        core = self.reg.core
        image = self._image()
        holders: dict[str, int] = {}
        holding = 0
        for _key, state, binding, _lease in image["sessions"]:
            if SessionState(state).holds_ref:
                holding += 1
                if binding is not None:
                    vid = from_wire(binding).version_id
                    holders[vid] = holders.get(vid, 0) + 1
        published = [v for v in core.status().versions if v.state is VersionState.PUBLISHED]
        assert len(published) == (0 if core.default_version is None else 1)
        assert core.status().live_sessions == holding
        for v in core.status().versions:
            # An EXPIRED or CLOSED Session holds nothing: refs never count one, never go negative.
            assert v.session_refs == holders.get(v.version_id, 0) >= 0, v
            if v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
                assert v.session_refs == 0  # nothing leaves RETIRED while a Session holds it

    @invariant()
    def live_leases_hold_only_live_sessions_that_name_them(self) -> None:
        image = self._image()
        sessions = {k: (SessionState(st_), lz) for k, st_, _b, lz in image["sessions"]}
        names = {n: (k, lz, at) for n, k, lz, at, _why in image["names"]}
        owners_seen: set[str] = set()
        for owner, inc, _ttl, _exp, keys, lease_names in image["leases"]:
            lid = f"{owner}/{inc}"
            assert owner not in owners_seen  # one live incarnation per owner
            owners_seen.add(owner)
            assert image["owners"][owner] == lid
            assert lid not in dict(image["dead_leases"])
            for key in keys:
                state, held_by = sessions[key]
                assert state.holds_ref, (lid, key, state)
                assert held_by == lid, (lid, key, held_by)
            for name in lease_names:
                assert names[name][1] == lid, (lid, name, names[name])
                assert names[name][2] is None, (lid, name, names[name])  # not a tombstone
        live = {f"{o}/{i}": set(keys) for o, i, _t, _e, keys, _n in image["leases"]}
        assert set(image["owners"].values()) == set(live)
        for key, (state, held_by) in sessions.items():
            # Conversely, a Session holding a ref under a lease is on that lease's books, so its
            # expiry will release it.
            if state.holds_ref and held_by is not None:
                assert key in live.get(held_by, set()), (key, held_by)
        for name, (key, lz, closed_at) in names.items():
            if closed_at is None:
                assert lz is None or lz in live, (name, lz)
                s = sessions.get(key)
                if s is not None:
                    # A live name's Session is BOUND and held where the name is.
                    assert s == (SessionState.BOUND, lz), (name, key, s)

    @invariant()
    def a_version_id_always_names_the_same_bytes(self) -> None:
        for v in self.reg.core.status().versions:
            seen = self.identities.setdefault(v.version_id, (v.digest, v.lora_name))
            assert (v.digest, v.lora_name) == seen, (v, seen)

    @invariant()
    def a_session_never_changes_version(self) -> None:
        core = self.reg.core
        for key, versions in self.bound_versions.items():
            assert len(versions) == 1, (key, versions)
            s = core.session(key)
            if s is not None and s.version_id is not None:
                assert {s.version_id} == versions, (key, s, versions)

    @invariant()
    def dispatchable_versions_are_ready_only_on_current_incarnations(self) -> None:
        image = self._image()
        current = image["incarnations"]
        for raw in image["versions"]:
            if not VersionState(raw["state"]).dispatchable:
                continue
            for r in raw["ready"]:
                receipt = from_wire(r)
                assert receipt.incarnation == current[receipt.engine], (raw["version_id"], r)

    @invariant()
    def a_tombstoned_name_keeps_its_key_until_swept(self) -> None:
        names = {n: (k, at) for n, k, _lz, at, _why in self._image()["names"]}
        for name, key in list(self.tombstoned.items()):
            if name not in names:
                del self.tombstoned[name]  # swept: the name may open a new Session now
                continue
            now_key, closed_at = names[name]
            assert now_key == key, (name, key, now_key)
            assert closed_at is not None, (name, "a tombstone came back to life")
        for name, (key, closed_at) in names.items():
            if closed_at is not None:
                self.tombstoned.setdefault(name, key)

    @invariant()
    def the_host_sweeps_whatever_it_holds(self) -> None:
        """Once the registry is in use, it sweeps as soon as it holds anything that expires
        (whoever opened it); before that, nothing runs."""
        assert self.reg.core.holds_deadlines() == self.model.holds_deadlines()
        if self.active and self.model.holds_deadlines():
            assert self.reg.sweeping
        if not self.active:
            assert not self.reg.sweeping

    @invariant()
    def sweep_due_agrees_with_the_model(self) -> None:
        for dt in (0.0, REPLAY_DELAY, 12.0):
            t = self.clock.t + dt
            assert self.reg.core.sweep_due(t, NAME_TTL) == self.model.sweep_due(t), t


# 120 runs of up to 60 steps: about 25 s of CPU with the journal in memory. Of 19 bugs injected
# by hand into the lease, name and restart code, each was caught in most runs at these settings,
# usually within 20 examples; test_core_leases.py pins every one of them deterministically.
# (No deadline and no too_slow check: the project's hypothesis profile, tests/conftest.py.)
RegistryMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60)
TestRegistryMachine = RegistryMachine.TestCase
