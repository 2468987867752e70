"""The status page's records: phase events grouped into operations, refusals tallied by code.

Driven with the events the publisher, cleanup, reclaimer and repairer emit (same phases, same
engine / fleet-wide split) and a hand-moved clock.
"""

from __future__ import annotations

import pytest

from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.gateway.ui.activity import UNTYPED_CODE
from agentic_lora.gateway.ui.activity import OperationKind
from agentic_lora.gateway.ui.activity import OperationLog
from agentic_lora.gateway.ui.activity import RefusalLog
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.publication.result import PublicationResult

STARTED, DONE, FAILED = PhaseStatus.STARTED, PhaseStatus.DONE, PhaseStatus.FAILED


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def phase(
    log: OperationLog,
    clock: Clock,
    version: str | None,
    engine: str | None,
    which: Phase,
    *,
    seconds: float = 0.5,
    fail: str | None = None,
) -> None:
    """One phase as a PhaseRecorder reports it: STARTED now, DONE/FAILED ``seconds`` later."""
    log(PhaseEvent(engine, which, STARTED, version_id=version))
    clock.now += seconds
    status = FAILED if fail else DONE
    log(PhaseEvent(engine, which, status, seconds, fail, version))


def publish(log: OperationLog, clock: Clock, version: str, engines: tuple[str, ...]) -> None:
    phase(log, clock, version, None, Phase.RESERVE, seconds=0.01)
    for engine in engines:
        phase(log, clock, version, engine, Phase.OBSERVE)
        phase(log, clock, version, engine, Phase.PREPARE, seconds=2.0)
        phase(log, clock, version, engine, Phase.RECORD_READY, seconds=0.01)
    phase(log, clock, version, None, Phase.COMMIT, seconds=0.01)


def result(version: str, outcome: PublicationOutcome) -> PublicationResult:
    return PublicationResult(version, "d" * 64, outcome, False, None, None, None, None, (), ())


def test_a_publication_is_one_operation_with_each_phase_timed_on_the_wall_clock() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    publish(log, clock, "step-1", ("e0", "e1"))
    (op,) = log.recent()
    assert (op.kind, op.version_id, op.outcome, op.error_code) == (
        OperationKind.PUBLISH,
        "step-1",
        "committed",
        None,
    )
    assert op.started_at == 1000.0
    assert [(s.engine, s.phase, s.status) for s in op.steps] == [
        (None, Phase.RESERVE, DONE),
        ("e0", Phase.OBSERVE, DONE),
        ("e0", Phase.PREPARE, DONE),
        ("e0", Phase.RECORD_READY, DONE),
        ("e1", Phase.OBSERVE, DONE),
        ("e1", Phase.PREPARE, DONE),
        ("e1", Phase.RECORD_READY, DONE),
        (None, Phase.COMMIT, DONE),
    ]
    prepare_e1 = op.steps[5]
    assert prepare_e1.seconds == 2.0
    assert prepare_e1.at == pytest.approx(1000.0 + 0.01 + 0.5 + 2.0 + 0.01 + 0.5)
    assert op.updated_at == clock.now


def test_a_phase_that_runs_is_a_started_step_and_the_operation_has_no_outcome() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    phase(log, clock, "v", None, Phase.RESERVE)
    log(PhaseEvent("e0", Phase.PREPARE, STARTED, version_id="v"))
    (op,) = log.recent()
    assert op.outcome is None
    assert (op.steps[-1].status, op.steps[-1].seconds) == (STARTED, None)
    clock.now += 3
    log(PhaseEvent("e0", Phase.PREPARE, DONE, 3.0, version_id="v"))
    assert [s.status for s in op.steps] == [DONE, DONE]  # the started step became the done one
    assert op.outcome == "done"  # nothing runs; no commit yet


def test_a_failed_publication_is_aborted_with_the_first_error_and_its_cleanups() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    phase(log, clock, "v", None, Phase.RESERVE)
    phase(log, clock, "v", "e0", Phase.PREPARE)
    phase(log, clock, "v", "e1", Phase.PREPARE, fail="BACKEND_REFUSED")
    phase(log, clock, "v", None, Phase.ABORT)
    for engine in ("e0", "e1"):
        phase(log, clock, "v", engine, Phase.CLEANUP)
        phase(log, clock, "v", engine, Phase.CONFIRM_CLEANUP)
    (op,) = log.recent()
    assert (op.kind, op.outcome, op.error_code) == (
        OperationKind.PUBLISH,
        "aborted",
        "BACKEND_REFUSED",
    )
    assert len(op.steps) == 8
    log.observe_publication(result("v", PublicationOutcome.FAILED_CLEAN))
    assert op.outcome == "failed_clean"


def test_the_result_names_the_outcome_and_a_later_resolve_is_its_own_operation() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    phase(log, clock, "v", None, Phase.RESERVE)
    phase(log, clock, "v", None, Phase.ABORT)
    phase(log, clock, "v", "e0", Phase.CLEANUP, fail="BACKEND_AMBIGUOUS")
    log.observe_publication(result("v", PublicationOutcome.BLOCKED))
    phase(log, clock, "v", "e0", Phase.CLEANUP)  # the resolver, later
    phase(log, clock, "v", "e0", Phase.CONFIRM_CLEANUP)
    resolve, publication = log.recent()
    assert (publication.kind, publication.outcome) == (OperationKind.PUBLISH, "blocked")
    assert (resolve.kind, resolve.outcome) == (OperationKind.RESOLVE, "done")
    assert resolve.seq == publication.seq + 1


def test_a_reserve_ends_every_publication_still_open() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    phase(log, clock, "skipped", None, Phase.RESERVE, fail="CAPACITY_ERROR")
    phase(log, clock, "again", None, Phase.RESERVE)  # already published: nothing after reserve
    publish(log, clock, "next", ("e0",))
    nxt, again, skipped = log.recent()
    assert (skipped.outcome, skipped.error_code) == ("failed", "CAPACITY_ERROR")
    assert again.outcome == "done"
    assert nxt.outcome == "committed"


def test_a_reclaim_and_a_repair_reload_are_operations_of_their_own() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    publish(log, clock, "v", ("e0",))
    phase(log, clock, "v", "e0", Phase.PREPARE)  # the repairer reloads it after a restart
    phase(log, clock, "v", "e0", Phase.RECORD_READY)
    phase(log, clock, "old", None, Phase.CLAIM_RECLAIM)
    log(PhaseEvent("e0", Phase.RECLAIM, STARTED, version_id="old"))
    reclaim, repair, publication = log.recent()
    assert (repair.kind, repair.version_id, len(repair.steps)) == (OperationKind.REPAIR, "v", 2)
    assert (reclaim.kind, reclaim.outcome) == (OperationKind.RECLAIM, None)
    clock.now += 1
    log(PhaseEvent("e0", Phase.RECLAIM, DONE, 1.0, version_id="old"))
    phase(log, clock, "old", "e0", Phase.CONFIRM_RECLAIM)
    assert reclaim.outcome == "reclaimed"
    assert publication.outcome == "committed"


def test_events_of_no_version_are_not_kept() -> None:
    log = OperationLog(clock=Clock())
    log(PhaseEvent("e0", Phase.OBSERVE, STARTED))
    log(PhaseEvent("e0", Phase.OBSERVE, DONE, 0.1))
    assert log.recent() == ()


def test_operations_and_steps_are_bounded() -> None:
    clock = Clock()
    log = OperationLog(max_operations=3, max_steps=4, clock=clock)
    for n in range(5):
        publish(log, clock, f"v{n}", ("e0", "e1"))
    assert [op.version_id for op in log.recent()] == ["v4", "v3", "v2"]
    newest = log.recent()[0]
    assert len(newest.steps) == 4
    # 8 phases, 16 events: 4 steps kept, every later event of the operation not.
    assert newest.dropped == 16 - 4 - 4
    assert newest.outcome == "committed"  # the commit still settles it
    with pytest.raises(ValueError, match="positive"):
        OperationLog(max_operations=0)


def test_a_result_for_a_version_no_event_named_changes_nothing() -> None:
    log = OperationLog(clock=Clock())
    log.observe_publication(result("never", PublicationOutcome.PUBLISHED))
    assert log.recent() == ()


def test_refusals_are_tallied_by_code_and_the_recent_ones_kept_newest_first() -> None:
    clock = Clock()
    log = RefusalLog(keep=2, clock=clock)
    log.record(InvalidRequestError("bad", reason="schema"), DispatchOutcome.REFUSED, "/generate")
    clock.now += 1
    log.record(RequestIndeterminateError("lost"), DispatchOutcome.INDETERMINATE, "/v1/completions")
    clock.now += 1
    log.record(RuntimeError("bug with session-secret"), DispatchOutcome.REFUSED, "/generate")
    assert log.total == 3
    assert dict(log.by_code) == {
        "INVALID_REQUEST": 1,
        "REQUEST_INDETERMINATE": 1,
        UNTYPED_CODE: 1,
    }
    assert log.by_outcome == {DispatchOutcome.REFUSED: 2, DispatchOutcome.INDETERMINATE: 1}
    assert [(r.code, r.at) for r in log.recent()] == [
        (UNTYPED_CODE, 1002.0),
        ("REQUEST_INDETERMINATE", 1001.0),
    ]
    assert "session-secret" not in repr(log.recent())  # a code, never a message
    with pytest.raises(ValueError, match="positive"):
        RefusalLog(keep=0)


def test_a_rollback_is_its_own_operation_whichever_way_it_goes() -> None:
    clock = Clock()
    log = OperationLog(clock=clock)
    # To a RETIRED version: observes (as a repair's would start), then the rollback step.
    for engine in ("e0", "e1"):
        phase(log, clock, "A", engine, Phase.OBSERVE)
    phase(log, clock, "A", None, Phase.ROLLBACK, seconds=0.01)
    # To a RECLAIMED version: its reload, then the commit that is the rollback.
    phase(log, clock, "B", None, Phase.RESERVE_ROLLBACK, seconds=0.01)
    for engine in ("e0", "e1"):
        phase(log, clock, "B", engine, Phase.PREPARE, seconds=1.0)
    phase(log, clock, "B", None, Phase.COMMIT, seconds=0.01)
    b, a = log.recent()
    assert (a.version_id, a.kind, a.final) == ("A", OperationKind.ROLLBACK, "rolled back")
    assert (b.version_id, b.kind, b.final) == ("B", OperationKind.ROLLBACK, "rolled back")
    assert [s.phase for s in a.steps] == [Phase.OBSERVE, Phase.OBSERVE, Phase.ROLLBACK]
    log.observe_publication(result("B", PublicationOutcome.PUBLISHED))
    assert log.recent()[0].final == "published"
