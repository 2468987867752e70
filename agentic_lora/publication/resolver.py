"""Blocked publications resolve themselves: cleanup of an aborted attempt is retried until every
engine confirmed it, and a publication nobody is finishing any more is aborted and cleaned.

::

    poke: a BLOCKED result, a publication that ended without a result, start(), an operator
        │
        v
    round: registry status -> the unresolved versions
           ABORTED (some engine's cleanup unconfirmed) ................ always
           LOADING, and nobody is publishing it ....................... found at start, or left
                                                                        behind by this publisher
        per version, under the publisher's lock (Publisher.resolve):
           LOADING -> abort;  per engine not yet confirmed: observe its incarnation
               (a new one: it holds nothing, the registry counts it cleaned, no call is made)
               else cleanup -> confirm_cleanup
        │ every engine confirmed: FAILED_CLEAN, slot freed   │ some unconfirmed: still BLOCKED
        v                                                    v
    wait for a poke                         wait (backoff: 1 s, 2 s, 4 s ... capped at 30 s)
                                            or a poke, whichever comes first; then again

Rules this module keeps, and what each one prevents:

* A resolve holds the publisher's lock, so it never aborts or cleans a version while this
  process is still publishing it: a cleanup racing a prepare could unload what is about to be
  committed, and an abort would fail a publication that was going to succeed.
* One publishing process per registry, and it is the process whose
  :class:`~agentic_lora.assembly.deployment.Deployment` owns this resolver's publisher. Only under that
  assumption does "LOADING, and this process is not publishing it" mean "abandoned": at start (the
  previous publishing process died with its publication) and for versions this process's
  publisher left behind (:attr:`Publisher.abandoned <agentic_lora.publication.publisher.Publisher.abandoned>`).
  A framework that publishes from one process through a shared registry (a Ray actor) must not run
  a Deployment in the others: rollout workers use :class:`~agentic_lora.session.Versioning`.
  ``resolve_loading_at_start=False`` turns the start-up adoption off.
* Unknown is never treated as released: a version leaves the unresolved set only when the registry
  says every engine confirmed its cleanup or restarted.
* Retries back off (a tenacity wait strategy, exponential by default) so an engine that stays
  down costs one cleanup attempt per interval, not a busy loop; a poke retries at once.

:meth:`Resolver.resolve` is the operator's verb (``agentic-lora resolve``, ``POST
/admin/resolve``). :meth:`Resolver.start` runs rounds in the background; :meth:`Resolver.settled`
waits for them (for tests and orderly shutdown). Progress comes as
:class:`~agentic_lora.publication.publisher.PhaseEvent` through the publisher's ``on_progress`` (abort,
observe_incarnation, cleanup, confirm_cleanup, each naming the version).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass

from tenacity.wait import wait_base

from agentic_lora.foundation.background import DEFAULT_BACKOFF_INITIAL
from agentic_lora.foundation.background import DEFAULT_BACKOFF_MAX
from agentic_lora.foundation.background import Rounds
from agentic_lora.foundation.background import backoff
from agentic_lora.foundation.background import delay_after
from agentic_lora.foundation.listeners import notify
from agentic_lora.publication.loop import BackgroundLoop
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.publication.publisher import Publisher
from agentic_lora.registry.types import VersionState

__all__ = [
    "DEFAULT_BACKOFF_INITIAL",
    "DEFAULT_BACKOFF_MAX",
    "QueuedListener",
    "ResolveReport",
    "Resolver",
    "backoff",
]

logger = logging.getLogger(__name__)

_UNRESOLVED = (VersionState.LOADING, VersionState.ABORTED)

#: ``listener(version_id)``: a resolve of ``version_id`` is about to wait for the publisher's lock
#: (called on the event loop; must not block). See :attr:`Resolver.on_queued`.
QueuedListener = Callable[[str], object]


@dataclass(frozen=True)
class ResolveReport:
    """What one resolve (a round, or an operator's call) did: one result per version it took."""

    results: tuple[PublicationResult, ...] = ()

    @property
    def resolved(self) -> tuple[str, ...]:
        """Versions that are no longer blocked (cleaned now, or nothing was left to do)."""
        return tuple(
            r.version_id for r in self.results if r.outcome is not PublicationOutcome.BLOCKED
        )

    @property
    def blocked(self) -> tuple[str, ...]:
        """Versions whose cleanup is still unconfirmed on some engine (their slot stays held)."""
        return tuple(r.version_id for r in self.results if r.outcome is PublicationOutcome.BLOCKED)


class Resolver(BackgroundLoop):
    """Resolves the publications ``publisher`` could not finish (see module docstring).

    It attaches itself to ``publisher`` (``publisher.resolver``), so a BLOCKED result pokes it.
    ``wait`` computes the pause after the n-th round in a row that left something blocked
    (default :func:`backoff`); ``sleep`` waits that long (inject one to step it in tests).
    """

    _loop_name = "agentic-lora resolver"

    def __init__(
        self,
        publisher: Publisher,
        *,
        wait: wait_base | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        resolve_loading_at_start: bool = True,
    ) -> None:
        self.publisher = publisher
        self.registry = publisher.registry
        self.wait = wait if wait is not None else backoff()
        self.resolve_loading_at_start = resolve_loading_at_start
        self._sleep = sleep
        self._at_start = False
        self._rounds = Rounds()
        #: Rounds in a row that left a publication blocked (0: nothing is waiting for a retry).
        self.failures = 0
        #: Seconds until the next retry round (None: the loop waits for a poke).
        self.retry_in: float | None = None
        #: Told the version id when a resolve of it queues behind the publisher's lock (a
        #: publication or another resolve is running), right before it waits; append any time.
        self.on_queued: list[QueuedListener] = []
        publisher.resolver = self

    # --- on demand ---------------------------------------------------------------------------

    async def resolve(self, version_id: str | None = None) -> ResolveReport:
        """Resolve ``version_id``, or every blocked or abandoned publication (the operator's verb).

        Without a version, a LOADING version counts as abandoned too: this waits for this
        process's own publication to end first, and there is no other publishing process (see
        the module docstring). A named version that is neither LOADING nor ABORTED is left alone;
        an unknown one is ``UNKNOWN_VERSION``.
        """
        if version_id is not None:
            return ResolveReport((await self._resolve_one(version_id, "resolved by operator"),))
        return await self._resolve_all(include_loading=True, reason="resolved by operator")

    async def resolve_pending(self) -> ResolveReport:
        """One round: every ABORTED version, and the LOADING ones known to be abandoned."""
        at_start = self._at_start
        report = await self._resolve_all(
            include_loading=at_start,
            reason="abandoned publication resolved at start"
            if at_start
            else "resolved in the background",
        )
        self._at_start = False  # only once a round has seen the registry
        return report

    # --- background ---------------------------------------------------------------------------

    def poke(self) -> None:
        """Ask for a round now (after a BLOCKED result); cuts a backoff wait short."""
        self._rounds.poke()

    def _starting(self) -> None:
        # The first round runs at once. A round a stop() cut short is safe to repeat: each abort
        # and each confirmation is one registry step, so the version is left LOADING or ABORTED
        # with its slot held, and resolved again by the next start or an operator.
        self._at_start = self.resolve_loading_at_start
        self._rounds.poke()

    async def settled(self, *, rounds: int = 0) -> None:
        """Return once no poke is pending, no round is running and ``rounds`` rounds finished.

        A backoff wait in progress counts as settled (:attr:`retry_in` says how long it is).
        """
        await self._rounds.settled(lambda: self._rounds.count >= rounds)

    async def _run(self) -> None:
        while True:
            await self._next_round()
            blocked: tuple[str, ...] = ()
            failed = False
            async with self._rounds.round():
                try:
                    blocked = (await self.resolve_pending()).blocked
                except Exception:
                    # The registry could not be read: nothing is known resolved, so retry later.
                    logger.exception("resolve round failed", extra={"failures": self.failures + 1})
                    failed = True
                finally:
                    # Before the round ends: settled() never sees a finished round's old backoff.
                    self.failures = self.failures + 1 if (blocked or failed) else 0
                    self.retry_in = delay_after(self.wait, self.failures) if self.failures else None
            if blocked:
                logger.warning(
                    "publication(s) %s still blocked; retrying in %.1f s",
                    ", ".join(blocked),
                    self.retry_in,
                    extra={"versions": list(blocked), "retry_in": self.retry_in},
                )

    async def _next_round(self) -> None:
        if self.retry_in is None:
            await self._rounds.wake.wait()
            return
        sleeper = asyncio.ensure_future(self._sleep(self.retry_in))
        poked = asyncio.ensure_future(self._rounds.wake.wait())
        try:
            await asyncio.wait((sleeper, poked), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, poked):
                task.cancel()
            # Collected, so a failing sleep never leaves an unretrieved exception behind.
            await asyncio.gather(sleeper, poked, return_exceptions=True)

    # --- one version --------------------------------------------------------------------------

    async def _resolve_all(self, *, include_loading: bool, reason: str) -> ResolveReport:
        status = await self.registry.status()
        states = {v.version_id: v.state for v in status.versions}
        abandoned = self.publisher.abandoned
        for version_id in list(abandoned):
            if states.get(version_id) not in _UNRESOLVED:
                abandoned.discard(version_id)  # finished since (published again, resolved)
        todo = [
            version_id
            for version_id, state in states.items()
            if state is VersionState.ABORTED
            or (state is VersionState.LOADING and (include_loading or version_id in abandoned))
        ]
        results = [await self._resolve_one(version_id, reason) for version_id in todo]
        return ResolveReport(tuple(results))

    async def _resolve_one(self, version_id: str, reason: str) -> PublicationResult:
        extra: dict[str, object] = {"version": version_id}
        if self.publisher.busy:
            logger.info(
                "resolve of %s waits for the publisher (a publication or resolve is running)",
                version_id,
                extra=extra,
            )
            notify(self.on_queued, version_id, logger=logger, what="on_queued", extra=extra)
        result = await self.publisher.resolve(version_id, reason=reason)
        extra.update(outcome=result.outcome.value, attempt=result.attempt)
        if result.outcome is PublicationOutcome.BLOCKED:
            logger.warning("%s still blocked: %s", version_id, result.reason, extra=extra)
        else:
            logger.info("%s resolved: %s", version_id, result.reason, extra=extra)
        return result
