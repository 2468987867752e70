"""Engine membership in the registry core as a hypothesis state machine: engines join, are
activated, drained, ejected and removed, restart (a new incarnation), interleaved with
publication (reserve, READY, commit, abort, cleanup), Sessions binding and releasing, and
reclaims.

The model predicts every membership verb's answer, each refusal by its own typed error (the
transition table's edges, the last ACTIVE member, the last member, an activation of an engine
that does not hold what it must, an ejection fenced by an older incarnation), and every commit's
(the default moves only when every ACTIVE member is READY for the candidate under its current
incarnation). After every step:

* only ACTIVE members are routable: each dispatchable version's routable engines are exactly the
  ACTIVE members the model says hold it;
* each version's Session refs equal the Sessions the model holds on it;
* a removed engine holds no slot: no version lists it as holding, cleaned or reclaimed;
* the fleet and the default are the model's.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from agentic_lora.errors import ActivateRefusedError
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import CapacityError
from agentic_lora.errors import DrainRefusedError
from agentic_lora.errors import EjectRefusedError
from agentic_lora.errors import EngineAlreadyMemberError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import MemberNotReadyError
from agentic_lora.errors import NotReadyError
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import RemoveRefusedError
from agentic_lora.errors import UnknownEngineError
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import VersionState

from .util import call
from .util import digest_of

M = MemberState
S = VersionState
POOL = ("e0", "e1", "e2", "e3")
SESSIONS = tuple(f"s{i}" for i in range(6))
CAPACITY = 3


class MembershipMachine(RuleBasedStateMachine):
    """The registry core against a model of membership, readiness and Session refs."""

    @initialize()
    def start(self) -> None:
        self.core = RegistryCore(engines=POOL[:2], capacity=CAPACITY)
        self.fleet: list[str] = list(POOL[:2])  # the members, in fleet order
        self.member: dict[str, MemberState] = dict.fromkeys(POOL, M.REMOVED)
        self.member.update(dict.fromkeys(self.fleet, M.ACTIVE))
        self.inc: dict[str, str | None] = dict.fromkeys(POOL)
        self.restarts = 0
        #: version -> engine -> the incarnation its counted READY was recorded under.
        self.ready: dict[str, dict[str, str]] = {}
        self.sessions: dict[str, str] = {}  # Session -> the version it is bound to
        self.default: str | None = None
        self.versions = 0
        for e in self.fleet:
            self._restart(e)
        self.publish()  # a default to bind to from the first step

    # --- helpers --------------------------------------------------------------------------------

    def _state(self, version_id: str) -> VersionState:
        state = self.core.state_of(version_id)
        assert state is not None
        return state

    def _of_state(self, *states: VersionState) -> list[str]:
        return [v for v in self.ready if self._state(v) in states]

    def _active(self) -> list[str]:
        return [e for e in self.fleet if self.member[e] is M.ACTIVE]

    def _holds(self, version_id: str, engine: str) -> bool:
        return self.ready[version_id].get(engine) == self.inc[engine]

    def _refs(self, version_id: str) -> int:
        return sum(1 for v in self.sessions.values() if v == version_id)

    def _needed(self, version_id: str) -> bool:
        state = self._state(version_id)
        return state in (S.PUBLISHED, S.LOADING) or (
            state is S.RETIRED and self._refs(version_id) > 0
        )

    def _restart(self, engine: str) -> None:
        self.restarts += 1
        new = f"inc-{self.restarts}"
        call(self.core, "observe_incarnation", engine=engine, incarnation=new)
        if self.inc[engine] is not None:
            # A new process holds nothing: READY of a loading or dispatchable version is void.
            for v, ready in self.ready.items():
                if self._state(v) is S.LOADING or self._state(v).dispatchable:
                    ready.pop(engine, None)
        self.inc[engine] = new

    def _verb(self, verb: str, expected: type[Exception] | None, **args: Any) -> Any:
        """``verb``'s answer, or None once it raised exactly ``expected`` (its own typed error);
        a verb the model expected refused must not be taken."""
        if expected is None:
            return call(self.core, verb, **args)
        with pytest.raises(AgenticLoRAError) as err:
            call(self.core, verb, **args)
        assert type(err.value) is expected, (verb, args, err.value, expected)
        return None

    # --- membership -----------------------------------------------------------------------------

    @rule(engine=st.sampled_from(POOL))
    def join(self, engine: str) -> None:
        member = self.member[engine] is not M.REMOVED
        expected = EngineAlreadyMemberError if member else None
        answer = self._verb("join_engine", expected, engine=engine)
        if answer is None:
            return
        assert answer is M.JOINING
        self.fleet.append(engine)
        self.member[engine] = M.JOINING
        self.inc[engine] = None

    @rule(engine=st.sampled_from(POOL), fenced=st.booleans())
    def activate(self, engine: str, fenced: bool) -> None:
        state = self.member[engine]
        incarnation = "inc-0" if fenced or self.inc[engine] is None else self.inc[engine]
        expected: type[Exception] | None = None
        if state is M.REMOVED:
            expected = UnknownEngineError
        elif state not in (M.JOINING, M.EJECTED):
            expected = ActivateRefusedError
        elif incarnation != self.inc[engine] or any(
            self._needed(v) and not self._holds(v, engine) for v in self.ready
        ):
            expected = MemberNotReadyError
        answer = self._verb("activate_engine", expected, engine=engine, incarnation=incarnation)
        if answer is None:
            return
        assert answer is M.ACTIVE
        self.member[engine] = M.ACTIVE

    @rule(engine=st.sampled_from(POOL))
    def drain(self, engine: str) -> None:
        state = self.member[engine]
        expected: type[Exception] | None = None
        if state is M.REMOVED:
            expected = UnknownEngineError
        elif state not in (M.ACTIVE, M.JOINING) or (
            state is M.ACTIVE and self._active() == [engine]
        ):
            expected = DrainRefusedError
        answer = self._verb("drain_engine", expected, engine=engine)
        if answer is None:
            return
        assert answer is M.DRAINING
        self.member[engine] = M.DRAINING

    @rule(engine=st.sampled_from(POOL), fenced=st.booleans())
    def eject(self, engine: str, fenced: bool) -> None:
        state = self.member[engine]
        incarnation = "inc-0" if fenced else self.inc[engine]
        expected: type[Exception] | None = None
        if state is M.REMOVED:
            expected = UnknownEngineError
        elif incarnation is not None and self.inc[engine] not in (None, incarnation):
            expected = EngineRestartedError
        elif state not in (M.ACTIVE, M.JOINING, M.DRAINING):
            expected = EjectRefusedError
        answer = self._verb("eject_engine", expected, engine=engine, incarnation=incarnation)
        if answer is None:
            return
        assert answer is M.EJECTED
        self.member[engine] = M.EJECTED

    @rule(engine=st.sampled_from(POOL))
    def remove(self, engine: str) -> None:
        state = self.member[engine]
        expected: type[Exception] | None = None
        if state is M.REMOVED:
            expected = UnknownEngineError
        elif state not in (M.DRAINING, M.EJECTED) or self.fleet == [engine]:
            expected = RemoveRefusedError
        answer = self._verb("remove_engine", expected, engine=engine)
        if answer is None:
            return
        assert answer is M.REMOVED
        self.fleet.remove(engine)
        self.member[engine] = M.REMOVED
        for ready in self.ready.values():
            ready.pop(engine, None)

    @precondition(lambda self: len(self.fleet) > 0)
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        self._restart(data.draw(st.sampled_from(self.fleet)))

    # --- publication ----------------------------------------------------------------------------

    @rule()
    def reserve(self) -> None:
        status = self.core.status()
        self.versions += 1
        version_id = f"v{self.versions}"
        try:
            r = call(self.core, "reserve", version_id=version_id, digest=digest_of(version_id))
        except PublicationBlockedError:
            assert status.pending_version is not None
            return
        except CapacityError:
            assert status.pending_version is None
            assert status.slots_in_use >= CAPACITY
            return
        assert status.pending_version is None
        assert status.slots_in_use < CAPACITY
        # A publication loads on the ACTIVE members: the set whose READY its commit needs.
        assert list(r.engines) == self._active()
        self.ready[version_id] = {}

    @precondition(lambda self: len(self.fleet) > 0)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        """An engine holds a version now (a publication's prepare, or a repair): its READY."""
        loadable = self._of_state(S.LOADING, S.PUBLISHED, S.RETIRED)
        if not loadable:
            return
        version_id = data.draw(st.sampled_from(loadable))
        self._record(version_id, data.draw(st.sampled_from(self.fleet)))

    def _record(self, version_id: str, engine: str) -> None:
        if self.inc[engine] is None:
            self._restart(engine)  # its first sighting
        incarnation = self.inc[engine]
        assert incarnation is not None
        ref = self.core.version(version_id).ref
        receipt = ReadyReceipt(engine=engine, ref=ref, incarnation=incarnation)
        call(self.core, "record_ready", receipt=receipt)
        self.ready[version_id][engine] = incarnation

    @rule()
    def prepare_on_every_active_member(self) -> None:
        """A publication's prepare succeeded everywhere it was asked: READY from every ACTIVE
        member for the pending candidate."""
        pending = self.core.status().pending_version
        if pending is not None and self._state(pending) is S.LOADING:
            for engine in self._active():
                self._record(pending, engine)

    @precondition(lambda self: len(self.fleet) > 0)
    @rule(data=st.data())
    def repair(self, data: st.DataObject) -> None:
        """A repair (or a join's loads): one engine gets every version the members need."""
        self._repair(data.draw(st.sampled_from(self.fleet)))

    def _repair(self, engine: str) -> None:
        if self.inc[engine] is None:
            self._restart(engine)  # the probe's first sighting
        for version_id in self.ready:
            if self._needed(version_id):
                self._record(version_id, engine)

    @rule(engine=st.sampled_from(POOL))
    def add(self, engine: str) -> None:
        """What an engine's addition does: join, load what the members need, activate."""
        if self.member[engine] is M.REMOVED:
            self.join(engine)
        if self.member[engine] in (M.JOINING, M.EJECTED):
            self._repair(engine)
            self.activate(engine, fenced=False)
            assert self.member[engine] is M.ACTIVE

    @rule(engine=st.sampled_from(POOL))
    def drain_and_remove(self, engine: str) -> None:
        """What a drain does once the engine's in-flight requests ended: drain, then remove."""
        self.drain(engine)
        if self.member[engine] is M.DRAINING:
            self.remove(engine)

    @rule()
    def publish(self) -> None:
        """A whole publication: reserve, READY from every ACTIVE member, commit."""
        self.reserve()
        self.prepare_on_every_active_member()
        self.commit()

    @rule()
    def commit(self) -> None:
        pending = self.core.status().pending_version
        if pending is None or self._state(pending) is not S.LOADING:
            return
        active = self._active()
        every_active_ready = bool(active) and all(self._holds(pending, e) for e in active)
        try:
            call(
                self.core,
                "commit",
                version_id=pending,
                attempt=self.core.version(pending).attempt,
                expected_default_revision=self.core.default_revision,
            )
        except NotReadyError:
            assert not every_active_ready
            return
        assert every_active_ready, f"{pending} committed without every ACTIVE member READY"
        self.default = pending

    @rule()
    def abort(self) -> None:
        pending = self.core.status().pending_version
        if pending is None or self._state(pending) is not S.LOADING:
            return
        attempt = self.core.version(pending).attempt
        call(self.core, "abort", version_id=pending, attempt=attempt, reason="test")
        self.ready[pending].clear()

    @precondition(lambda self: len(self.fleet) > 0)
    @rule(data=st.data())
    def confirm_cleanup(self, data: st.DataObject) -> None:
        aborted = self._of_state(S.ABORTED)
        if not aborted:
            return
        version_id = data.draw(st.sampled_from(aborted))
        engine = data.draw(st.sampled_from(self.fleet))
        attempt = self.core.version(version_id).attempt
        call(self.core, "confirm_cleanup", version_id=version_id, attempt=attempt, engine=engine)

    # --- Sessions and reclaim ------------------------------------------------------------------

    @rule(session=st.sampled_from(SESSIONS))
    def bind(self, session: str) -> None:
        if session in self.sessions or self.core.session(session) is not None:
            return  # one binding per Session key
        if self.default is None:
            return
        binding = call(self.core, "bind_first", session_key=session)
        assert binding.version_id == self.default
        self.sessions[session] = self.default

    @rule(session=st.sampled_from(SESSIONS))
    def release(self, session: str) -> None:
        if session not in self.sessions:
            return
        call(self.core, "begin_close", session_key=session)
        call(self.core, "release", session_key=session)
        call(self.core, "forget_sessions", session_keys=[session])
        del self.sessions[session]

    @precondition(lambda self: len(self.fleet) > 0)
    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        unheld = [v for v in self._of_state(S.RETIRED) if self._refs(v) == 0]
        reclaiming = self._of_state(S.RECLAIMING)
        if not unheld and not reclaiming:
            return
        version_id = data.draw(st.sampled_from(unheld + reclaiming))
        claim = call(self.core, "claim_reclaim", version_id=version_id)
        engine = data.draw(st.sampled_from(self.fleet))
        call(
            self.core,
            "confirm_reclaim",
            version_id=version_id,
            reclaim_id=claim.reclaim_id,
            engine=engine,
        )

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def only_active_members_are_routable(self) -> None:
        for version_id, ready in self.ready.items():
            view = self.core.dispatch_view(version_id)
            assert view is not None
            if not view.state.dispatchable:
                continue
            expected = tuple(e for e in self.fleet if self.member[e] is M.ACTIVE and e in ready)
            assert view.ready_engines == expected, (version_id, view.ready_engines, expected)

    @invariant()
    def session_refs_are_the_sessions_holding_each_version(self) -> None:
        for version_id in self.ready:
            assert self.core.version(version_id).session_refs == self._refs(version_id)

    @invariant()
    def a_removed_engine_holds_no_slot(self) -> None:
        status = self.core.status()
        assert [e.engine for e in status.engines] == self.fleet
        assert {e.engine: e.membership for e in status.engines} == {
            e: self.member[e] for e in self.fleet
        }
        gone = {e for e in POOL if self.member[e] is M.REMOVED}
        for v in status.versions:
            listed = {*v.held_engines, *v.cleaned_engines, *v.reclaimed_engines}
            assert not listed & gone, (v.version_id, listed & gone)

    @invariant()
    def the_default_is_the_models(self) -> None:
        assert self.core.default_version == self.default


MembershipMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_membership_machine = MembershipMachine.TestCase
