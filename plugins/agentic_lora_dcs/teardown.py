"""Cleanup and reclaim: make sure nothing of an attempt, or of a retired name, remains loaded.

Concurrent duplicates of one cleanup (or one reclaim) share a single run, shielded so that a
caller going away never cancels the engine call the others wait on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from typing import TypeVar

from agentic_lora.engines.admin import UnloadOutcome
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora_dcs.attempts import AttemptRecord
from agentic_lora_dcs.attempts import AttemptState
from agentic_lora_dcs.attempts import Refused
from agentic_lora_dcs.protocol import CleanupReply
from agentic_lora_dcs.protocol import CleanupRequest
from agentic_lora_dcs.protocol import Reason
from agentic_lora_dcs.protocol import ReclaimOutcome
from agentic_lora_dcs.protocol import ReclaimReply
from agentic_lora_dcs.protocol import ReclaimRequest
from agentic_lora_dcs.receiver_state import ReceiverState
from agentic_lora_dcs.receiver_state import runtime_key
from agentic_lora_dcs.staging import consume_exception

__all__ = ["TeardownSteps"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_K = TypeVar("_K")


class TeardownSteps(ReceiverState):
    """The ``cleanup`` and ``reclaim`` verbs of a receiver."""

    async def cleanup(self, req: CleanupRequest) -> CleanupReply:
        """Make sure nothing of this attempt remains; concurrent duplicates share one run."""
        key = (req.lora_name, req.attempt)
        return await self._coalesce(self._cleanups, key, lambda: self._run_cleanup(req))

    async def _run_cleanup(self, req: CleanupRequest) -> CleanupReply:
        record = self._ledger.get(req.lora_name, req.attempt)
        runtime = None if record is None else self._runtimes.get(runtime_key(record))
        if record is not None and record.state is AttemptState.LOADING and runtime is not None:
            assert runtime.end_task is not None
            # Let the load settle first: cleaning up under a running load would race it.
            await asyncio.wait([runtime.end_task])
        no_history = not any(r.lora_name == req.lora_name for r in self._ledger)
        if record is not None and record.state in (AttemptState.READY, AttemptState.UNCERTAIN):
            await self._unload(record.lora_name, record)
        elif record is None and no_history:
            await self._refuse_if_loaded_by_unknown(req.lora_name)
        decision = self._ledger.cleanup(req.lora_name, req.attempt)
        for old in decision.superseded:
            self._drop(old, why="fenced by a newer cleanup")
        if decision.previous is not None:
            self._drop(decision.record, why="cleanup")
        if decision.previous in (AttemptState.READY, AttemptState.UNCERTAIN):
            await self._store.remove(req.lora_name)
        logger.info(
            "cleanup %s attempt %d: %s",
            req.lora_name,
            req.attempt,
            decision.outcome,
            extra={"version": req.lora_name, "attempt": req.attempt},
        )
        return CleanupReply(lora_name=req.lora_name, attempt=req.attempt, outcome=decision.outcome)

    async def _refuse_if_loaded_by_unknown(self, lora_name: str) -> None:
        # This sidecar incarnation never saw the name, yet an earlier one may have loaded it into
        # this still-running engine, for this attempt or a later one. It cannot tell which, so it
        # neither unloads (that could hit a committed version) nor claims the attempt is clean.
        try:
            loaded = await self._engine.list_lora_adapters()
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            raise Refused(Reason.ENGINE_UNCERTAIN, exc.message, clean=False) from exc
        if lora_name in loaded:
            raise Refused(
                Reason.ENGINE_UNCERTAIN,
                f"{lora_name} is loaded by an attempt this sidecar incarnation never saw",
                clean=False,
            )

    async def _unload(self, lora_name: str, record: AttemptRecord | None) -> UnloadOutcome:
        try:
            return await self._engine.unload_lora_adapter(lora_name)
        except BackendRefusedError as exc:
            raise Refused(Reason.ENGINE_REFUSED, exc.message, clean=False) from exc
        except BackendAmbiguousError as exc:
            if record is not None and record.state is AttemptState.READY:
                record.move_to(AttemptState.UNCERTAIN)
            raise Refused(Reason.ENGINE_UNCERTAIN, exc.message, clean=False) from exc

    # --- reclaim --------------------------------------------------------------------------------

    async def reclaim(self, req: ReclaimRequest) -> ReclaimReply:
        """Unload a retired name once (the engine waits for its in-flight requests)."""
        done_by = self._ledger.reclaim_id(req.lora_name)
        if done_by is not None:
            return ReclaimReply(
                lora_name=req.lora_name,
                reclaim_id=req.reclaim_id,
                outcome=ReclaimOutcome.ALREADY_UNLOADED,
            )
        return await self._coalesce(self._reclaims, req.lora_name, lambda: self._run_reclaim(req))

    async def _run_reclaim(self, req: ReclaimRequest) -> ReclaimReply:
        for record in self._ledger.holders(req.lora_name):
            runtime = self._runtimes.get(runtime_key(record))
            if record.state is AttemptState.LOADING and runtime and runtime.end_task:
                await asyncio.wait([runtime.end_task])
        outcome = await self._unload(req.lora_name, None)
        await self._store.remove(req.lora_name)
        self._ledger.mark_reclaimed(req.lora_name, req.reclaim_id)
        for record in self._ledger:
            if record.lora_name == req.lora_name:
                self._drop(record, why="reclaimed")
        logger.info(
            "reclaimed %s (%s): %s",
            req.lora_name,
            req.reclaim_id,
            outcome,
            extra={"version": req.lora_name},
        )
        return ReclaimReply(
            lora_name=req.lora_name,
            reclaim_id=req.reclaim_id,
            outcome=(
                ReclaimOutcome.UNLOADED
                if outcome is UnloadOutcome.UNLOADED
                else ReclaimOutcome.ABSENT
            ),
        )

    @staticmethod
    async def _coalesce(
        table: dict[_K, asyncio.Task[_T]], key: _K, run: Callable[[], Awaitable[_T]]
    ) -> _T:
        task = table.get(key)
        if task is None:
            task = asyncio.ensure_future(run())
            table[key] = task
            task.add_done_callback(consume_exception)
            task.add_done_callback(lambda _t: table.pop(key, None))
        # Shielded: one caller going away never cancels the engine call others wait on.
        return await asyncio.shield(task)
