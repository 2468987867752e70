"""Publishing trained adapters off the training thread: capture, coalesce, publish, account.

::

    training thread                         bridge loop (DeploymentThread)
    ---------------                         ------------------------------
    AdapterWeights.capture(model, step=N)   (owned copy of the step-N LoRA tensors)
    publisher.submit(weights)  ── returns ─>  pending slot: holds ONE AdapterWeights (latest wins)
                                             worker: take pending -> freeze AdapterSnapshot (hash,
                                             off the loop) -> Deployment.publish -> account

Rules this module keeps:

* **Exactly the step-N weights.** :meth:`AdapterWeights.capture` copies the LoRA tensors on the
  training thread, before ``on_step_end`` returns, so the optimizer's next step cannot touch them.
  Freezing them into an :class:`~agentic_lora.AdapterSnapshot` (serialising and hashing) happens
  on the worker, on a copy nobody else holds: the digest names exactly those bytes.
* **Never blocks the trainer.** :meth:`AdapterPublisher.submit` takes a lock for a few pointer
  moves and wakes the worker; it never waits for an engine.
* **Coalesced, latest wins.** One publication runs at a time; what is submitted meanwhile waits
  in one slot, and a newer submission replaces it (counted as ``coalesced``). Memory is bounded by
  two copies of the adapter (the one publishing, the one waiting), however slow the engines are.
* **Capacity.** With few slots the version retired two publications ago may still be held by
  Sessions (or its unload may still be draining) when the next reservation comes, and the
  publisher answers SKIPPED (``CAPACITY_ERROR``) after its own reclaim round. The worker then
  publishes the same weights again, at most ``capacity_retries`` times, and only while they are
  still the latest. Before each retry it waits until a slot may be free: a version of the
  registry became RECLAIMED or FAILED_CLEAN (read from the registry's change feed, so the retry
  follows the reclaim at once), or ``capacity_wait`` passed (0.5 s, 1 s, 2 s ... at most 5 s; the
  only wake-up with a registry that has no change feed). A newer submission ends the wait too and
  replaces the weights (``coalesced``). Retries exhausted: the publication counts as ``skipped``
  and is logged; the next submission tries again. Listeners of
  :attr:`AdapterPublisher.on_capacity_wait` are told ``(weights, retry)`` when a wait starts.
* **Failures are never swallowed.** A publication that raised, ended FAILED_CLEAN or BLOCKED, or
  whose snapshot could not be built is logged at ERROR, counted, and kept in
  :attr:`AdapterPublisher.failures`; :meth:`AdapterPublisher.raise_for` raises them
  (:class:`~agentic_lora_trl.errors.PublicationFailedError`) when the trainer asks, at the end of
  training.
* **Stop.** When the bridge closes, the worker finishes the publication it is running (an
  interrupted one would leave engines loading), stops retrying, and drops what is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from typing import Any

from tenacity.wait import wait_base

from agentic_lora import PublicationOutcome
from agentic_lora import PublicationResult
from agentic_lora import VersionState
from agentic_lora.errors import error_code
from agentic_lora.foundation.background import backoff
from agentic_lora.foundation.background import delay_after
from agentic_lora.foundation.listeners import notify
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.types import VersionStatus
from agentic_lora_trl.bridge import DeploymentThread
from agentic_lora_trl.errors import BridgeClosedError
from agentic_lora_trl.errors import PublicationFailedError
from agentic_lora_trl.weights import AdapterWeights

__all__ = [
    "DEFAULT_CAPACITY_RETRIES",
    "AdapterPublisher",
    "PublicationFailure",
    "PublicationStats",
    "default_capacity_wait",
]

logger = logging.getLogger(__name__)

#: How often the worker publishes the same weights again after a capacity refusal.
DEFAULT_CAPACITY_RETRIES = 5


def default_capacity_wait() -> wait_base:
    """0.5 s, 1 s, 2 s, 4 s, then 5 s between two capacity retries."""
    return backoff(0.5, 5.0)


# --- what the worker reports ------------------------------------------------------------------


@dataclass(frozen=True)
class PublicationFailure:
    """One publication that did not make its weights the default (and why)."""

    step: int
    version_id: str
    code: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PublicationStats:
    """Counters of one :class:`AdapterPublisher` (a consistent copy; see ``as_logs``)."""

    submitted: int = 0
    published: int = 0
    coalesced: int = 0
    skipped: int = 0
    failed: int = 0
    capacity_retries: int = 0
    last_submitted_step: int | None = None
    last_published_step: int | None = None
    last_published_version: str | None = None

    def as_logs(self) -> dict[str, float]:
        """The trainer-log form: ``agentic_lora/<counter>`` (and the last published step)."""
        logs: dict[str, float] = {
            "agentic_lora/publications": float(self.published),
            "agentic_lora/publications_coalesced": float(self.coalesced),
            "agentic_lora/publications_skipped": float(self.skipped),
            "agentic_lora/publication_failures": float(self.failed),
            "agentic_lora/capacity_retries": float(self.capacity_retries),
        }
        if self.last_published_step is not None:
            logs["agentic_lora/published_step"] = float(self.last_published_step)
        return logs


@dataclass
class _Slots:
    """The worker's state shared with other threads (always under the publisher's lock)."""

    pending: AdapterWeights | None = None
    running: AdapterWeights | None = None
    stopped: bool = False
    stats: PublicationStats = field(default_factory=PublicationStats)
    failures: list[PublicationFailure] = field(default_factory=list)


# --- the worker -------------------------------------------------------------------------------


class AdapterPublisher:
    """Publishes :class:`AdapterWeights` through ``thread``'s Deployment, one at a time, latest
    wins (see module docstring). Construct it on any thread but the bridge's, once the bridge
    runs; it stops when the bridge closes."""

    def __init__(
        self,
        thread: DeploymentThread,
        *,
        capacity_retries: int = DEFAULT_CAPACITY_RETRIES,
        capacity_wait: wait_base | None = None,
    ) -> None:
        if capacity_retries < 0:
            raise ValueError("capacity_retries must be >= 0")
        self._thread = thread
        self.capacity_retries = capacity_retries
        self.capacity_wait = capacity_wait if capacity_wait is not None else default_capacity_wait()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._slots = _Slots()
        #: Told ``(weights, retry)`` on the loop when a capacity wait starts (a test acts then).
        self.on_capacity_wait: list[Callable[[AdapterWeights, int], object]] = []
        self._wake: asyncio.Event | None = None
        #: Set by a submission, a stop, or a freed slot: ends a capacity wait.
        self._nudge: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        thread.run(self._start())
        thread.on_close(self.stop)

    # --- any thread --------------------------------------------------------------------------

    @property
    def stats(self) -> PublicationStats:
        with self._lock:
            return self._slots.stats

    @property
    def failures(self) -> tuple[PublicationFailure, ...]:
        with self._lock:
            return tuple(self._slots.failures)

    def submit(self, weights: AdapterWeights) -> None:
        """Hand ``weights`` to the worker and return at once; a submission still waiting is
        replaced (``coalesced``). Raises BridgeClosedError once the publisher stopped."""
        with self._lock:
            slots = self._slots
            if slots.stopped:
                raise BridgeClosedError(
                    f"the publisher stopped; step {weights.step} was not submitted",
                    step=weights.step,
                )
            replaced = slots.pending
            slots.pending = weights
            slots.stats = replace(
                slots.stats,
                submitted=slots.stats.submitted + 1,
                coalesced=slots.stats.coalesced + (replaced is not None),
                last_submitted_step=weights.step,
            )
        if replaced is not None:
            logger.info(
                "step %d superseded by step %d before it was published",
                replaced.step,
                weights.step,
                extra={"step": replaced.step, "version": replaced.version_id},
            )
        self._thread.call_soon(self._wake_worker)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or publishing (True), or ``timeout`` passed (False).

        Never call it on the bridge's thread: the worker it waits for runs there.
        """
        if self._thread.in_loop_thread():
            raise RuntimeError("AdapterPublisher.flush would block the loop it waits for")
        with self._idle:
            return self._idle.wait_for(
                lambda: (
                    self._slots.stopped
                    or (self._slots.pending is None and self._slots.running is None)
                ),
                timeout,
            )

    def raise_for(self, step: int, *, when: str) -> None:
        """Raise PublicationFailedError if a publication failed, or if ``step`` is not the last
        step published (its weights never became the default). ``when`` names the moment, for
        the message."""
        with self._lock:
            failures = list(self._slots.failures)
            stats = self._slots.stats
        if not failures and stats.last_published_step == step:
            return
        problems = [f"step {f.step} ({f.version_id}): {f.code}" for f in failures]
        if stats.last_published_step != step:
            problems.append(
                f"step {step} is not the default (last published step: "
                f"{stats.last_published_step}, capacity skips: {stats.skipped})"
            )
        raise PublicationFailedError(
            f"publication failed, seen at {when}: {'; '.join(problems)}",
            step=step,
            last_published_step=stats.last_published_step,
            failures=[f.to_dict() for f in failures],
            skipped=stats.skipped,
        )

    # --- on the bridge's loop ----------------------------------------------------------------

    async def _start(self) -> None:
        self._wake = asyncio.Event()
        self._nudge = asyncio.Event()
        feed = change_feed(self._thread.deployment.registry)
        if feed is not None:
            feed.add_listener(self._on_registry_change)
        self._task = asyncio.get_running_loop().create_task(
            self._work(), name="agentic-lora trl publisher"
        )

    def _wake_worker(self) -> None:
        assert self._wake is not None
        assert self._nudge is not None
        self._wake.set()
        self._nudge.set()

    def _on_registry_change(self, verb: str, result: object) -> None:
        # A slot is free again once a version is RECLAIMED (or an aborted one FAILED_CLEAN).
        if isinstance(result, VersionStatus) and result.state in (
            VersionState.RECLAIMED,
            VersionState.FAILED_CLEAN,
        ):
            nudge = self._nudge
            assert nudge is not None
            if self._thread.in_loop_thread():
                nudge.set()
            else:
                self._thread.call_soon(nudge.set)

    async def stop(self) -> None:
        """Stop taking submissions, drop the pending one, let a running publication end, and
        wait for the worker to exit."""
        with self._idle:
            slots = self._slots
            slots.stopped = True
            dropped, slots.pending = slots.pending, None
            self._idle.notify_all()
        if dropped is not None:
            logger.warning(
                "step %d was never published: the publisher stopped first",
                dropped.step,
                extra={"step": dropped.step, "version": dropped.version_id},
            )
        self._wake_worker()
        if self._task is not None:
            await self._task

    async def _work(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            with self._lock:
                if self._slots.stopped:
                    return
                weights, self._slots.pending = self._slots.pending, None
                self._slots.running = weights
            if weights is None:
                continue
            try:
                await self._publish(weights)
            except Exception as exc:
                # A fault of the worker's own: recorded like any failure, and the worker lives
                # on (a dead worker would leave every later submission waiting forever).
                self._failed(weights, error_code(exc), repr(exc))
            finally:
                with self._idle:
                    self._slots.running = None
                    self._idle.notify_all()

    def _superseded(self, weights: AdapterWeights) -> bool:
        """Whether ``weights`` should be given up: newer weights wait (counted ``coalesced``)
        or the publisher stopped (logged as dropped)."""
        with self._lock:
            stopped = self._slots.stopped
            newer = self._slots.pending is not None
        if stopped:
            logger.warning(
                "step %d was never published: the publisher stopped during its capacity retries",
                weights.step,
                extra={"step": weights.step, "version": weights.version_id},
            )
        elif newer:
            self._count(coalesced=1)
        return stopped or newer

    async def _publish(self, weights: AdapterWeights) -> None:
        try:
            # Serialising and hashing is CPU work: off the loop, which also serves the rollouts.
            snapshot = await asyncio.to_thread(weights.snapshot)
        except Exception as exc:
            self._failed(weights, error_code(exc), str(exc))
            return
        deployment = self._thread.deployment
        nudge = self._nudge
        assert nudge is not None
        attempt = 0
        while True:
            # Cleared before the attempt: a slot freed while it runs still ends the next wait.
            nudge.clear()
            try:
                result = await deployment.publish(weights.version_id, snapshot)
            except Exception as exc:
                self._failed(weights, error_code(exc), str(exc))
                return
            if result.ok:
                self._published(weights, result)
                return
            if result.outcome is not PublicationOutcome.SKIPPED:
                self._failed(weights, result.outcome.value, result.reason or "")
                return
            attempt += 1
            if self._superseded(weights):
                return
            if attempt > self.capacity_retries:
                self._skipped(weights, result)
                return
            delay = delay_after(self.capacity_wait, attempt)
            logger.info(
                "no free version slot for step %d; publishing it again in %.1f s (retry %d of %d)",
                weights.step,
                delay,
                attempt,
                self.capacity_retries,
                extra={"step": weights.step, "version": weights.version_id, "retry": attempt},
            )
            self._count(capacity_retries=1)
            notify(
                self.on_capacity_wait,
                weights,
                attempt,
                logger=logger,
                what="on_capacity_wait",
                extra={"step": weights.step, "version": weights.version_id},
            )
            await self._wait_for_slot(delay)
            if self._superseded(weights):
                return

    async def _wait_for_slot(self, seconds: float) -> None:
        """Wait ``seconds``, or less if a slot may have been freed, a newer submission came or
        the publisher stopped. The worker's own wake is left set, so its loop takes a newer
        submission next."""
        nudge = self._nudge
        assert nudge is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await nudge.wait()

    # --- accounting ------------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            stats = self._slots.stats
            self._slots.stats = replace(
                stats, **{name: getattr(stats, name) + delta for name, delta in deltas.items()}
            )

    def _published(self, weights: AdapterWeights, result: PublicationResult) -> None:
        with self._lock:
            stats = self._slots.stats
            self._slots.stats = replace(
                stats,
                published=stats.published + 1,
                last_published_step=weights.step,
                last_published_version=weights.version_id,
            )
        logger.info(
            "step %d is the default as %s (%s)",
            weights.step,
            weights.version_id,
            result.outcome.value,
            extra={"step": weights.step, "version": weights.version_id, "digest": result.digest},
        )

    def _skipped(self, weights: AdapterWeights, result: PublicationResult) -> None:
        self._count(skipped=1)
        logger.warning(
            "step %d was not published: no free version slot after %d retries (%s); "
            "the next submission tries again",
            weights.step,
            self.capacity_retries,
            result.reason,
            extra={"step": weights.step, "version": weights.version_id},
        )

    def _failed(self, weights: AdapterWeights, code: str, message: str) -> None:
        failure = PublicationFailure(weights.step, weights.version_id, code, message)
        with self._lock:
            self._slots.failures.append(failure)
            stats = self._slots.stats
            self._slots.stats = replace(stats, failed=stats.failed + 1)
        logger.error(
            "publication of step %d as %s failed: %s %s",
            weights.step,
            weights.version_id,
            code,
            message,
            extra={"step": weights.step, "version": weights.version_id, "code": code},
        )
