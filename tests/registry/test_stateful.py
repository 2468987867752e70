"""The registry against a small reference model, under every interleaving hypothesis finds.

Rules cover publication (reserve/ready/commit/abort/cleanup), Sessions (bind/close/release/forget),
reclaim (claim/confirm), engine restarts, registry restarts (journal replay), lost replies (apply,
drop the answer, replay with the same request id) and duplicate delivery. After every step the
invariants of the design are checked against the real registry.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import ReadyReceipt, SessionState, VersionState, new_request_id

from .util import digest_of

ENGINES = ("e0", "e1")
CAPACITY = 2
VERSION_IDS = ("v1", "v2", "v3", "v4")
CONTENTS = ("a", "b")
SESSIONS = ("s1", "s2", "s3")
DELIVERY = st.sampled_from(["once", "lost_reply", "duplicate"])
HOLDS_SLOT = {"LOADING", "PUBLISHED", "RETIRED", "RECLAIMING", "ABORTED"}


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


class Model:
    """What the registry must do, written as plainly as possible."""

    def __init__(self) -> None:
        self.versions: dict[str, MVersion] = {}
        self.default: str | None = None
        self.revision = 0
        self.pending: str | None = None
        self.incarnation = dict.fromkeys(ENGINES, 0)
        self.known = dict.fromkeys(ENGINES, False)
        self.sessions: dict[str, tuple[str, str | None]] = {}

    def slots(self) -> int:
        return sum(1 for v in self.versions.values() if v.state in HOLDS_SLOT)


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="lora-registry-"))
        self.loop = asyncio.new_event_loop()
        self.reg = self._open()
        self.model = Model()

    def _open(self) -> LocalRegistry:
        return LocalRegistry(
            engines=ENGINES, capacity=CAPACITY, journal_path=self.dir / "j.sqlite", compact_every=11
        )

    def teardown(self) -> None:
        self.loop.run_until_complete(self.reg.aclose())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- delivery: once, lost reply (apply, drop, replay), duplicate ---------------------------

    def _do(self, delivery: str, verb: str, **args: Any) -> Any:
        rid = new_request_id()
        default_before = self.reg.core.default_version
        first = self._attempt(verb, rid, args)
        if delivery != "once":
            second = self._attempt(verb, rid, args)
            if isinstance(first, AgenticLoRAError):
                assert isinstance(second, AgenticLoRAError)
                assert second.code == first.code
            else:
                assert second == first, (verb, first, second)
        if verb != "commit":
            # The default changes only at a commit.
            assert self.reg.core.default_version == default_before
        return first

    def _attempt(self, verb: str, rid: str, args: dict[str, Any]) -> Any:
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

    # --- publication ---------------------------------------------------------------------------

    @rule(
        version_id=st.sampled_from(VERSION_IDS),
        content=st.sampled_from(CONTENTS),
        delivery=DELIVERY,
    )
    def reserve(self, version_id: str, content: str, delivery: str) -> None:
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
        elif v.state == "ABORTED":
            code = "PUBLICATION_BLOCKED"
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

    def _receipt(
        self, version_id: str, engine: str, attempt: int, incarnation: int
    ) -> ReadyReceipt:
        v = self.reg.core.version(version_id)
        return ReadyReceipt(
            engine, version_id, v.digest, v.lora_name, attempt, f"inc-{incarnation}"
        )

    @precondition(lambda self: self.model.pending is not None)
    @rule(engine=st.sampled_from(ENGINES), stale=st.booleans(), delivery=DELIVERY)
    def ready(self, engine: str, stale: bool, delivery: str) -> None:
        m = self.model
        assert m.pending is not None
        v = m.versions[m.pending]
        attempt = v.attempt - 1 if stale and v.attempt > 1 else v.attempt
        inc = m.incarnation[engine]
        if v.state != "LOADING":
            code = "STALE_ATTEMPT" if attempt < v.attempt else "INVALID_STATE"
        elif attempt != v.attempt:
            code = "STALE_ATTEMPT"
        else:
            code = None
        result = self._do(
            delivery, "record_ready", receipt=self._receipt(m.pending, engine, attempt, inc)
        )
        if self._expect(result, code):
            v.ready[engine] = inc
            m.known[engine] = True

    @precondition(lambda self: self.model.pending is not None)
    @rule(delivery=DELIVERY, stale_revision=st.booleans())
    def commit(self, delivery: str, stale_revision: bool) -> None:
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
        if m.default is not None:
            m.versions[m.default].state = "RETIRED"
        v.state, v.committed_attempt = "PUBLISHED", v.attempt
        m.default, m.pending = vid, None
        m.revision += 1
        assert result.default_revision == m.revision

    @precondition(lambda self: self.model.pending is not None)
    @rule(delivery=DELIVERY)
    def abort(self, delivery: str) -> None:
        m = self.model
        vid = m.pending
        assert vid is not None
        v = m.versions[vid]
        result = self._do(delivery, "abort", version_id=vid, attempt=v.attempt, reason="test")
        self._expect(result, None)
        v.state, v.ready = "ABORTED", {}

    @precondition(lambda self: any(v.state == "ABORTED" for v in self.model.versions.values()))
    @rule(engine=st.sampled_from(ENGINES), delivery=DELIVERY)
    def confirm_cleanup(self, engine: str, delivery: str) -> None:
        m = self.model
        vid = next(k for k, v in m.versions.items() if v.state == "ABORTED")
        v = m.versions[vid]
        result = self._do(
            delivery, "confirm_cleanup", version_id=vid, attempt=v.attempt, engine=engine
        )
        self._expect(result, None)
        v.cleaned.add(engine)
        if v.cleaned == set(ENGINES):
            v.state = "FAILED_CLEAN"
            m.pending = None

    @rule(engine=st.sampled_from(ENGINES), delivery=DELIVERY)
    def engine_restart(self, engine: str, delivery: str) -> None:
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
                    v.state = "FAILED_CLEAN"
                    if m.pending == vid:
                        m.pending = None
            elif v.state == "RECLAIMING":  # nothing reloads a reclaiming version
                v.reclaimed.add(engine)
                if v.reclaimed == set(ENGINES):
                    v.state = "RECLAIMED"

    # --- Sessions ------------------------------------------------------------------------------

    @rule(session=st.sampled_from(SESSIONS), delivery=DELIVERY)
    def bind(self, session: str, delivery: str) -> None:
        m = self.model
        s = m.sessions.get(session)
        if s is not None:
            code = None if s[0] == "BOUND" else "SESSION_CLOSED"
        else:
            code = None if m.default is not None else "NO_PUBLISHED_VERSION"
        result = self._do(delivery, "bind_first", session_key=session)
        if not self._expect(result, code):
            return
        if s is None:
            assert m.default is not None
            m.sessions[session] = ("BOUND", m.default)
            m.versions[m.default].refs += 1
            assert result.version_id == m.default
        else:
            assert result.version_id == s[1]  # bound at most once: the first answer forever

    @rule(session=st.sampled_from(SESSIONS), delivery=DELIVERY)
    def begin_close(self, session: str, delivery: str) -> None:
        m = self.model
        result = self._do(delivery, "begin_close", session_key=session)
        self._expect(result, None)
        s = m.sessions.get(session)
        if s is None:
            m.sessions[session] = ("CLOSING", None)
        elif s[0] == "BOUND":
            m.sessions[session] = ("CLOSING", s[1])

    @rule(session=st.sampled_from(SESSIONS), delivery=DELIVERY)
    def release(self, session: str, delivery: str) -> None:
        m = self.model
        s = m.sessions.get(session)
        code = None if s is not None and s[0] in ("CLOSING", "CLOSED") else "INVALID_STATE"
        result = self._do(delivery, "release", session_key=session)
        if not self._expect(result, code):
            return
        assert s is not None
        assert result.released_now == (s[0] == "CLOSING")
        if s[0] == "CLOSING":
            m.sessions[session] = ("CLOSED", s[1])
            if s[1] is not None:
                m.versions[s[1]].refs -= 1  # released at most once

    @rule(session=st.sampled_from(SESSIONS), delivery=DELIVERY)
    def forget(self, session: str, delivery: str) -> None:
        m = self.model
        s = m.sessions.get(session)
        code = None if s is None or s[0] == "CLOSED" else "SESSION_STILL_BOUND"
        result = self._do(delivery, "forget_sessions", session_keys=[session])
        if self._expect(result, code):
            m.sessions.pop(session, None)

    # --- reclaim -------------------------------------------------------------------------------

    @rule(version_id=st.sampled_from(VERSION_IDS), delivery=DELIVERY)
    def claim_reclaim(self, version_id: str, delivery: str) -> None:
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

    @precondition(lambda self: any(v.state == "RECLAIMING" for v in self.model.versions.values()))
    @rule(engine=st.sampled_from(ENGINES), delivery=DELIVERY)
    def confirm_reclaim(self, engine: str, delivery: str) -> None:
        m = self.model
        vid = next(k for k, v in m.versions.items() if v.state == "RECLAIMING")
        v = m.versions[vid]
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

    @rule()
    def registry_restart(self) -> None:
        before = self.loop.run_until_complete(self.reg.status())
        sessions = {k: self.reg.core.session(k) for k in SESSIONS}
        self.loop.run_until_complete(self.reg.aclose())
        self.reg = self._open()
        assert self.loop.run_until_complete(self.reg.status()) == before
        assert {k: self.reg.core.session(k) for k in SESSIONS} == sessions

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        m = self.model
        core = self.reg.core
        st_ = core.status()
        assert st_.default_version == m.default
        assert st_.default_revision == m.revision
        assert st_.pending_version == m.pending
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
            assert (got_s.state.value, got_s.version_id) == want if got_s else want is None

    @invariant()
    def refs_match_sessions_and_reclaim_waits_for_them(self) -> None:
        core = self.reg.core
        holders: dict[str, int] = {}
        for key in SESSIONS:
            s = core.session(key)
            if s is not None and s.state is not SessionState.CLOSED and s.version_id is not None:
                holders[s.version_id] = holders.get(s.version_id, 0) + 1
        published = [v for v in core.status().versions if v.state is VersionState.PUBLISHED]
        assert len(published) == (0 if core.default_version is None else 1)
        for v in core.status().versions:
            assert v.session_refs == holders.get(v.version_id, 0)
            if v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
                assert v.session_refs == 0  # nothing leaves RETIRED while a Session holds it


RegistryMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRegistryMachine = RegistryMachine.TestCase
