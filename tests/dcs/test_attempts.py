"""The sidecar's attempt ledger, driven by arbitrary message orders (no processes, no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
from agentic_lora_dcs.attempts import TRANSITIONS
from agentic_lora_dcs.attempts import AttemptIdentity
from agentic_lora_dcs.attempts import AttemptState
from agentic_lora_dcs.attempts import BeginDecision
from agentic_lora_dcs.attempts import BucketDecision
from agentic_lora_dcs.attempts import EndDecision
from agentic_lora_dcs.attempts import IllegalTransitionError
from agentic_lora_dcs.attempts import Ledger
from agentic_lora_dcs.attempts import Refused
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import BucketState
from agentic_lora_dcs.protocol import CleanupOutcome
from agentic_lora_dcs.protocol import Reason
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from tests.dcs.util import make_snapshot

NAME = "policy_lora@0-v1-0123456789abcdef"
PLAN = plan_for_snapshot(make_snapshot(seed=71, layers=1, hidden=16, rank=2), 256)
BUCKETS = len(PLAN.buckets)


def identity(driver: str, incarnation: str, *, digest: str = "a" * 64) -> AttemptIdentity:
    return AttemptIdentity(
        version_id="v1",
        digest=digest,
        backend="gloo",
        config_json="{}",
        plan=PLAN,
        incarnation=incarnation,
        driver=driver,
    )


_T = TypeVar("_T")


def _attempt(call: Callable[[], _T]) -> _T | Refused:
    try:
        return call()
    except Refused as refused:
        return refused


class LedgerMachine(RuleBasedStateMachine):
    """Messages of three attempts in any order, engine restarts, loads that settle any way."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.engine = 0
        self.cleaned: set[int] = set()
        self.reclaimed = False
        self.fences = 0
        self.cleanups = 0
        self.arms: dict[tuple[int, int], int] = {}  # (id(record), index) -> ARM decisions
        self._alive: list[object] = []

    @property
    def incarnation(self) -> str:
        return f"side/e{self.engine}"

    def _newest(self) -> int:
        return max((r.attempt for r in self.ledger), default=0)

    attempts = st.integers(1, 3)
    drivers = st.sampled_from(["d1", "d2", "d3"])

    @rule(attempt=attempts, driver=drivers)
    def begin(self, attempt: int, driver: str) -> None:
        existing = self.ledger.get(NAME, attempt)
        newest = self._newest()
        outcome = _attempt(
            lambda: self.ledger.begin(NAME, attempt, identity(driver, self.incarnation))
        )
        if isinstance(outcome, Refused):
            if self.reclaimed:
                expected: Reason | None = Reason.RECLAIMED
            elif attempt in self.cleaned:
                expected = Reason.FENCED
            elif existing is None and attempt < newest:
                expected = Reason.STALE_ATTEMPT
            else:
                expected = None  # other refusals (active, stale driver) are allowed here
            assert expected is None or outcome.reason is expected, (outcome.reason, expected)
            return
        decision, record, retired = outcome
        assert not self.reclaimed
        assert attempt not in self.cleaned, "a cleaned attempt came back"
        if existing is None:
            assert attempt >= newest, "a stale Begin created a record"
        if decision is BeginDecision.NEW:
            assert record.state is AttemptState.PREPARED
            assert record.armed == 0
        for old in retired:
            assert old.state is AttemptState.CLEANED

    def _draw_attempt(self, data: st.DataObject) -> int:
        # Mostly attempts that exist (so transfers progress), sometimes any (stale, unknown).
        known = sorted({r.attempt for r in self.ledger})
        if not known:
            return data.draw(self.attempts)
        return data.draw(st.sampled_from(known) | self.attempts)

    @rule(data=st.data())
    def bucket(self, data: st.DataObject) -> None:
        attempt = self._draw_attempt(data)
        record = self.ledger.get(NAME, attempt)
        nxt = 0 if record is None else record.armed
        # Mostly the next index; sometimes a duplicate, one out of order or one outside the plan.
        index = data.draw(st.sampled_from([nxt]) | st.integers(0, BUCKETS))
        try:
            decision, record, state = self.ledger.bucket(NAME, attempt, index)
        except Refused:
            return
        if decision is BucketDecision.ARM:
            self._alive.append(record)  # keeps id(record) unique for the whole example
            key = (id(record), index)
            self.arms[key] = self.arms.get(key, 0) + 1
            assert state is BucketState.ARMED

    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        attempt = self._draw_attempt(data)
        try:
            decision, record = self.ledger.end(NAME, attempt)
        except Refused as refused:
            if refused.reason is Reason.INCOMPLETE:
                record = self.ledger.get(NAME, attempt)
                assert record is not None
                assert record.armed < BUCKETS
            return
        if decision is EndDecision.START:
            assert record.armed == BUCKETS
            assert record.state is AttemptState.LOADING

    @rule(
        outcome=st.sampled_from([AttemptState.READY, AttemptState.FAILED, AttemptState.UNCERTAIN])
    )
    def a_load_settles(self, outcome: AttemptState) -> None:
        for record in self.ledger:
            if record.state is AttemptState.LOADING:
                record.move_to(outcome)
                return

    def _loading(self) -> bool:
        return any(r.state is AttemptState.LOADING for r in self.ledger)

    def _cleanup(self, attempt: int) -> None:
        before = self.ledger.get(NAME, attempt)
        others = {r.attempt: r.state for r in self.ledger if r.attempt != attempt}
        decision = self.ledger.cleanup(NAME, attempt)
        assert decision.record.state in (AttemptState.CLEANED, AttemptState.RECLAIMED)
        if before is None:
            assert decision.outcome is CleanupOutcome.FENCED
        retired = {r.attempt for r in decision.superseded}
        for record in self.ledger:
            if record.attempt != attempt and record.attempt not in retired:
                assert record.state == others[record.attempt], "a cleanup touched another attempt"
        self.cleaned.add(attempt)

    # Budgets keep the rarer events rare, so attempts get far enough to arm and load.
    @precondition(lambda self: not self._loading() and self.cleanups < 3)
    @rule(attempt=attempts)
    def cleanup(self, attempt: int) -> None:
        if self.ledger.get(NAME, attempt) is not None:
            self.cleanups += 1
            self._cleanup(attempt)

    @precondition(lambda self: not self._loading() and self.fences < 2)
    @rule(attempt=attempts)
    def cleanup_overtakes_its_begin(self, attempt: int) -> None:
        if self.ledger.get(NAME, attempt) is None:
            self.fences += 1
            self._cleanup(attempt)

    @precondition(lambda self: self.engine < 2)
    @rule()
    def engine_restarts(self) -> None:
        self.engine += 1

    # Only a version that was loaded somewhere is ever reclaimed (it was published).
    @precondition(
        lambda self: not self._loading() and any(r.state is AttemptState.READY for r in self.ledger)
    )
    @rule()
    def reclaim(self) -> None:
        self.ledger.mark_reclaimed(NAME, "r1")
        self.reclaimed = True

    @invariant()
    def each_key_is_armed_at_most_once(self) -> None:
        assert all(count == 1 for count in self.arms.values())
        for record in self.ledger:
            assert record.received <= record.armed <= BUCKETS

    @invariant()
    def at_most_one_attempt_holds_the_live_engine(self) -> None:
        live = [
            r
            for r in self.ledger
            if r.state is AttemptState.LOADING
            or (
                r.state.may_hold_engine
                and r.identity is not None
                and r.identity.incarnation == self.incarnation
            )
        ]
        assert len(live) <= 1, [(r.attempt, r.state) for r in live]

    @invariant()
    def cleaned_attempts_stay_cleaned(self) -> None:
        for attempt in self.cleaned:
            record = self.ledger.get(NAME, attempt)
            assert record is not None
            assert record.state in (AttemptState.CLEANED, AttemptState.RECLAIMED)


LedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestLedger = LedgerMachine.TestCase


def test_the_transition_table_is_closed_and_terminal_states_are_final() -> None:
    assert set(TRANSITIONS) == set(AttemptState)
    assert TRANSITIONS[AttemptState.CLEANED] == frozenset()
    assert TRANSITIONS[AttemptState.RECLAIMED] == frozenset()
    ledger = Ledger()
    ledger.cleanup(NAME, 1)
    record = ledger.get(NAME, 1)
    assert record is not None
    with pytest.raises(IllegalTransitionError):
        record.move_to(AttemptState.PREPARED)


def test_a_superseded_driver_and_a_conflicting_identity_are_refused() -> None:
    ledger = Ledger()
    ledger.begin(NAME, 1, identity("d1", "s/e0"))
    # d2 takes the stash-only attempt over; d1's Begin, arriving late, is now stale.
    decision, _, retired = ledger.begin(NAME, 1, identity("d2", "s/e0"))
    assert decision is BeginDecision.NEW
    assert len(retired) == 1
    with pytest.raises(Refused) as stale:
        ledger.begin(NAME, 1, identity("d1", "s/e0"))
    assert stale.value.reason is Reason.STALE_DRIVER
    with pytest.raises(Refused) as conflict:
        ledger.begin(NAME, 1, identity("d3", "s/e0", digest="b" * 64))
    assert conflict.value.reason is Reason.ATTEMPT_CONFLICT
    assert conflict.value.clean is False


def test_a_loaded_attempt_blocks_a_newer_one_until_its_engine_is_gone() -> None:
    ledger = Ledger()
    _, record, _ = ledger.begin(NAME, 1, identity("d1", "s/e0"))
    record.armed = BUCKETS
    ledger.end(NAME, 1)
    record.move_to(AttemptState.READY)
    with pytest.raises(Refused) as active:
        ledger.begin(NAME, 2, identity("d2", "s/e0"))
    assert active.value.reason is Reason.ATTEMPT_ACTIVE
    # A new driver of the same attempt resumes it instead of transferring again...
    decision, same, _ = ledger.begin(NAME, 1, identity("d3", "s/e0"))
    assert (decision, same) == (BeginDecision.RESUME, record)
    # ...unless the engine restarted: then nothing is held and attempt 2 may begin.
    decision, _, _ = ledger.begin(NAME, 2, identity("d4", "s/e1"))
    assert decision is BeginDecision.NEW


def test_a_reclaimed_name_refuses_every_message() -> None:
    ledger = Ledger()
    ledger.begin(NAME, 1, identity("d1", "s/e0"))
    ledger.mark_reclaimed(NAME, "r1")
    for call in (
        lambda: ledger.begin(NAME, 2, identity("d2", "s/e0")),
        lambda: ledger.bucket(NAME, 1, 0),
        lambda: ledger.end(NAME, 1),
    ):
        with pytest.raises(Refused) as refused:
            call()
        assert refused.value.reason is Reason.RECLAIMED
    assert ledger.reclaimed_names() == (NAME,)
