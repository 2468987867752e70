"""What the status page remembers between registry reads: recent operations and refusals.

The registry's status is a snapshot: it says which versions exist, never how a publication went.
Two bounded, I/O-free records fill that gap, fed by hooks the gateway already has:

* :class:`OperationLog` hears every :class:`~agentic_lora.foundation.phases.PhaseEvent` (the
  gateway's :class:`~agentic_lora.gateway.progress.ProgressHub`) and groups them into the
  operations they belong to: a publication (reserve, per-engine observe / prepare / ready, commit
  or abort and cleanup), a rollback, a reclaim, a resolve or a repair reload, each stamped with wall-clock
  times. It keeps the last ``max_operations`` operations and at most ``max_steps`` steps each.
* :class:`RefusalLog` hears every failed generation request (its stable error code, outcome and
  route): a tally per code since start and a ring of the most recent ones.

Both take the clock as an argument, so tests and the benchmark drive them without sleeping.
Neither ever holds a Session id or a message (messages may quote one): codes, routes, version
ids and engine names only.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.publication.result import PublicationResult

__all__ = [
    "UNTYPED_CODE",
    "Operation",
    "OperationKind",
    "OperationLog",
    "Refusal",
    "RefusalLog",
    "Step",
]

#: The code a failure without a stable code is counted under (a type name is an open set).
UNTYPED_CODE = "AGENTIC_LORA_ERROR"


class OperationKind(enum.StrEnum):
    """What an operation was, from the phase it started with."""

    PUBLISH = "publish"  # started with reserve
    RECLAIM = "reclaim"  # claim_reclaim / reclaim / confirm_reclaim
    RESOLVE = "resolve"  # abort or cleanup of a version no publication here was running
    REPAIR = "repair"  # a reload of a committed version (an engine restarted)
    ROLLBACK = "rollback"  # a version committed before made the default again


_KIND_OF_FIRST_PHASE: dict[Phase, OperationKind] = {
    Phase.RESERVE: OperationKind.PUBLISH,
    Phase.CLAIM_RECLAIM: OperationKind.RECLAIM,
    Phase.RECLAIM: OperationKind.RECLAIM,
    Phase.CONFIRM_RECLAIM: OperationKind.RECLAIM,
    Phase.ABORT: OperationKind.RESOLVE,
    Phase.CLEANUP: OperationKind.RESOLVE,
    Phase.CONFIRM_CLEANUP: OperationKind.RESOLVE,
    Phase.RESERVE_ROLLBACK: OperationKind.ROLLBACK,
}


#: Operations whose result the gateway hears (a publication's, a rollback's).
_RESULT_KINDS = frozenset({OperationKind.PUBLISH, OperationKind.ROLLBACK})


@dataclass(frozen=True, slots=True)
class Step:
    """One phase of an operation.

    ``at``: wall-clock time the phase started; ``seconds``: how long it took (None while it
    runs, ``status`` STARTED); ``engine`` None for a fleet-wide phase.
    """

    phase: Phase
    engine: str | None
    status: PhaseStatus
    at: float
    seconds: float | None = None
    error_code: str | None = None


@dataclass
class Operation:
    """One publication, reclaim, resolve or repair of one version, as its phase events told it.

    ``final`` is set once nothing more can belong to it: its commit, a failed reserve, the
    publication's result (its outcome in lower case: ``published``, ``skipped``, ``blocked``,
    ...) or the next publication's reserve. ``dropped`` counts steps beyond the log's
    ``max_steps``.
    """

    seq: int
    kind: OperationKind
    version_id: str
    started_at: float
    updated_at: float
    steps: list[Step] = field(default_factory=list)
    final: str | None = None
    error_code: str | None = None
    dropped: int = 0
    _open: dict[tuple[Phase, str | None], int] = field(default_factory=dict, repr=False)

    @property
    def outcome(self) -> str | None:
        """How it ended (None: a phase still runs): ``final`` when set, else ``aborted``,
        ``reclaimed``, ``failed`` or ``done`` from the steps it has."""
        if self.final is not None:
            return self.final
        if self._open:
            return None
        done = {s.phase for s in self.steps if s.status is PhaseStatus.DONE}
        if Phase.ABORT in done:
            return "aborted"
        if self.kind is OperationKind.RECLAIM and Phase.CONFIRM_RECLAIM in done:
            return "reclaimed"
        if any(s.status is PhaseStatus.FAILED for s in self.steps):
            return "failed"
        return "done"


class OperationLog:
    """The recent operations, grouped from phase events (see the module docstring).

    Call it as a progress listener (``hub.subscribe(log)``). An event joins the newest operation
    of its version that is not final, else starts a new one whose kind its phase says.
    Publications run one at a time, so a reserve makes every earlier publication final.
    :meth:`observe_publication` names the exact outcome when the gateway saw the result.
    """

    def __init__(
        self,
        *,
        max_operations: int = 32,
        max_steps: int = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_operations < 1 or max_steps < 1:
            raise ValueError("max_operations and max_steps must be positive")
        self._ops: deque[Operation] = deque(maxlen=max_operations)
        self._max_steps = max_steps
        self._clock = clock
        self._seq = 0

    def __call__(self, event: PhaseEvent) -> None:
        if event.version_id is None:
            return  # an engine probe of no version: the engines table shows what it found
        now = self._clock()
        op = self._operation_for(event, now)
        op.updated_at = now
        if event.phase in (Phase.RESERVE_ROLLBACK, Phase.ROLLBACK):
            # A rollback to a RETIRED version starts with observes, as a repair would.
            op.kind = OperationKind.ROLLBACK
        key = (event.phase, event.engine)
        if event.status is PhaseStatus.STARTED:
            self._add_step(op, Step(event.phase, event.engine, event.status, now), key)
        else:
            started = now - (event.seconds or 0.0)
            step = Step(
                event.phase, event.engine, event.status, started, event.seconds, event.error_code
            )
            index = op._open.pop(key, None)
            if index is not None:
                op.steps[index] = step
            else:
                self._add_step(op, step, None)
            if event.status is PhaseStatus.FAILED:
                op.error_code = op.error_code or event.error_code
        if event.engine is None and event.status is not PhaseStatus.STARTED:
            if event.phase is Phase.ROLLBACK and event.status is PhaseStatus.DONE:
                op.final = "rolled back"
            elif event.phase is Phase.COMMIT and event.status is PhaseStatus.DONE:
                op.final = "rolled back" if op.kind is OperationKind.ROLLBACK else "committed"
            elif event.phase is Phase.RESERVE and event.status is PhaseStatus.FAILED:
                op.final = "failed"

    def observe_publication(self, result: PublicationResult) -> None:
        """A publication's result: its outcome becomes the operation's final one."""
        for op in reversed(self._ops):
            if op.version_id == result.version_id and op.kind in _RESULT_KINDS:
                op.final = result.outcome.value.lower()
                op.updated_at = self._clock()
                return

    def recent(self) -> tuple[Operation, ...]:
        """The kept operations, newest first."""
        return tuple(reversed(self._ops))

    # --- grouping -------------------------------------------------------------------------------

    def _operation_for(self, event: PhaseEvent, now: float) -> Operation:
        assert event.version_id is not None
        if event.phase is Phase.RESERVE and event.status is PhaseStatus.STARTED:
            for op in self._ops:
                if op.kind is OperationKind.PUBLISH and op.final is None:
                    op.final = op.outcome or "ended"
        else:
            for op in reversed(self._ops):
                if op.version_id == event.version_id and op.final is None:
                    return op
        kind = _KIND_OF_FIRST_PHASE.get(event.phase, OperationKind.REPAIR)
        self._seq += 1
        op = Operation(self._seq, kind, event.version_id, now, now)
        self._ops.append(op)
        return op

    def _add_step(self, op: Operation, step: Step, key: tuple[Phase, str | None] | None) -> None:
        if len(op.steps) >= self._max_steps:
            op.dropped += 1
            return
        if key is not None:
            op._open[key] = len(op.steps)
        op.steps.append(step)


@dataclass(frozen=True, slots=True)
class Refusal:
    """One failed generation request: when, its stable code, outcome and route."""

    at: float
    code: str
    outcome: DispatchOutcome
    route: str


class RefusalLog:
    """Failed generation requests: a tally per code since start and the most recent ones."""

    def __init__(self, *, keep: int = 64, clock: Callable[[], float] = time.time) -> None:
        if keep < 1:
            raise ValueError("keep must be positive")
        self._recent: deque[Refusal] = deque(maxlen=keep)
        self._clock = clock
        self.by_code: Counter[str] = Counter()
        self.by_outcome: Counter[DispatchOutcome] = Counter()

    def record(self, error: BaseException, outcome: DispatchOutcome, route: str) -> None:
        """One failed request (``route``: the route's path, a closed set)."""
        code = error.code if isinstance(error, AgenticLoRAError) else UNTYPED_CODE
        self._recent.append(Refusal(self._clock(), code, outcome, route))
        self.by_code[code] += 1
        self.by_outcome[outcome] += 1

    @property
    def total(self) -> int:
        return sum(self.by_code.values())

    def recent(self) -> tuple[Refusal, ...]:
        """The kept refusals, newest first."""
        return tuple(reversed(self._recent))
