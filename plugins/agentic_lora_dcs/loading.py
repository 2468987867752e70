"""The End of an attempt: every bucket in, the full manifest verified, the adapter loaded pinned.

An End materialises the immutable adapter directory through the store, loads it into the engine
and confirms that the same engine process serves the exact name (READY). A duplicate End shares
the one running load; an End after an uncertain load rechecks what the engine lists instead of
loading again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import VersionConflictError
from agentic_lora_dcs.attempts import AttemptIdentity
from agentic_lora_dcs.attempts import AttemptRecord
from agentic_lora_dcs.attempts import AttemptState
from agentic_lora_dcs.attempts import EndDecision
from agentic_lora_dcs.attempts import Refused
from agentic_lora_dcs.protocol import EndRequest
from agentic_lora_dcs.protocol import ReadyReply
from agentic_lora_dcs.protocol import Reason
from agentic_lora_dcs.receiver_state import ReceiverState
from agentic_lora_dcs.receiver_state import runtime_key
from agentic_lora_dcs.staging import Staging
from agentic_lora_dcs.staging import consume_exception

__all__ = ["LoadSteps"]

logger = logging.getLogger(__name__)


class LoadSteps(ReceiverState):
    """The ``end`` verb of a receiver and the load steps behind it."""

    async def end(self, req: EndRequest) -> ReadyReply:
        """Verify the full manifest, materialise the directory, load it pinned: READY_LOCAL."""
        # An End that crossed a sidecar restart may have loaded through the old sidecar.
        self._check_sidecar(req.incarnation, clean=False)
        record = self._ledger.get(req.lora_name, req.attempt)
        self._check_attempt_incarnation(req.incarnation, record)
        try:
            decision, record = self._ledger.end(req.lora_name, req.attempt)
        except Refused as refused:
            self._fail_on_violation(record, refused)
            raise
        runtime = self._runtimes[runtime_key(record)]
        if decision is EndDecision.DONE:
            assert runtime.ready is not None
            return runtime.ready.model_copy(update={"duplicate": True})
        if runtime.end_task is None or runtime.end_task.done():
            if decision is EndDecision.START:
                runtime.end_task = asyncio.create_task(self._run_end(record, runtime))
            elif decision is EndDecision.RECHECK:
                runtime.end_task = asyncio.create_task(self._recheck(record, runtime))
            assert runtime.end_task is not None
            runtime.end_task.add_done_callback(consume_exception)
            runtime.end_task.add_done_callback(lambda _: self._forget_if_dropped(record))
        assert runtime.end_task is not None
        # Shielded: a caller that disconnects never cancels a load half-way.
        reply = await asyncio.shield(runtime.end_task)
        return (
            reply if decision is EndDecision.START else reply.model_copy(update={"duplicate": True})
        )

    async def _recheck(self, record: AttemptRecord, runtime: Staging) -> ReadyReply:
        """An UNCERTAIN load settles READY only if the engine lists it at our directory."""
        assert record.identity is not None
        path = self._store.path_for(record.lora_name)
        try:
            current = await self.current_incarnation()
            listed = await self._engine.list_lora_adapters()
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            raise Refused(Reason.ENGINE_UNCERTAIN, exc.message, clean=False) from exc
        if current != record.identity.incarnation or listed.get(record.lora_name) != str(path):
            raise Refused(
                Reason.ENGINE_UNCERTAIN,
                f"{record.lora_name} attempt {record.attempt}: the load is still unconfirmed",
                clean=False,
            )
        return await self._confirm(record, runtime, path)

    async def _run_end(self, record: AttemptRecord, runtime: Staging) -> ReadyReply:
        try:
            path = await self._materialise(record, runtime)
        except Refused as refused:
            self._fail(record, refused.reason)
            raise
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            # Only the incarnation read can fail this way here; nothing was loaded yet.
            self._fail(record, Reason.ENGINE_UNAVAILABLE)
            raise Refused(Reason.ENGINE_UNAVAILABLE, exc.message, clean=True) from exc
        except Exception as exc:
            # Before the load nothing reached the engine, and the store writes atomically.
            logger.exception("End of %s attempt %d failed", record.lora_name, record.attempt)
            self._fail(record, Reason.INTERNAL)
            raise Refused(
                Reason.INTERNAL, f"End failed before the load: {exc!r}", clean=True
            ) from exc
        try:
            return await self._load(record, runtime, path)
        except Refused:
            raise
        except Exception as exc:
            logger.exception("load of %s attempt %d failed", record.lora_name, record.attempt)
            self._uncertain(record)
            raise Refused(Reason.INTERNAL, f"load outcome unknown: {exc!r}", clean=False) from exc

    async def _materialise(self, record: AttemptRecord, runtime: Staging) -> Path:
        """Every bucket in, same engine process, full manifest verified, directory stored."""
        assert record.identity is not None
        identity = record.identity
        for index in range(record.buckets):
            await self._settle_receive(record, index)
        current = await self.current_incarnation()
        if current != identity.incarnation:
            raise Refused(
                Reason.ENGINE_RESTARTED,
                f"engine restarted ({identity.incarnation} -> {current}) before the load",
                clean=True,
                current=current,
            )
        # Validation and hashing of a large adapter take a while: off the event loop.
        snapshot = await asyncio.to_thread(_verified_snapshot, identity, dict(runtime.stash))
        runtime.stash.clear()
        try:
            return await self._store.put(record.lora_name, snapshot)
        except VersionConflictError as exc:
            raise Refused(Reason.MANIFEST_MISMATCH, exc.message, clean=True) from exc

    async def _load(self, record: AttemptRecord, runtime: Staging, path: Path) -> ReadyReply:
        try:
            await self._engine.load_lora_adapter(record.lora_name, str(path), pinned=True)
        except BackendRefusedError as exc:
            await self._store.remove(record.lora_name)
            self._fail(record, Reason.ENGINE_REFUSED)
            raise Refused(Reason.ENGINE_REFUSED, exc.message, clean=True) from exc
        except BackendAmbiguousError as exc:
            self._uncertain(record)
            raise Refused(Reason.ENGINE_UNCERTAIN, exc.message, clean=False) from exc
        return await self._confirm(record, runtime, path)

    async def _confirm(self, record: AttemptRecord, runtime: Staging, path: Path) -> ReadyReply:
        """After a load: the engine is still the same process and serves the exact name."""
        assert record.identity is not None
        identity = record.identity
        try:
            after = await self.current_incarnation()
            if self._probe:
                await self._engine.probe_generate(record.lora_name)
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            self._uncertain(record)
            raise Refused(Reason.ENGINE_UNCERTAIN, exc.message, clean=False) from exc
        if after != identity.incarnation:
            # The load went to one process or the other; only a cleanup settles which.
            self._uncertain(record)
            raise Refused(
                Reason.ENGINE_UNCERTAIN,
                f"engine restarted during the load ({identity.incarnation} -> {after})",
                clean=False,
            )
        record.move_to(AttemptState.READY)
        runtime.ready = ReadyReply(
            lora_name=record.lora_name,
            attempt=record.attempt,
            version_id=identity.version_id,
            digest=identity.digest,
            incarnation=identity.incarnation,
            lora_path=str(path),
            duplicate=False,
        )
        runtime.release()
        logger.info(
            "READY %s attempt %d",
            record.lora_name,
            record.attempt,
            extra={"version": record.lora_name, "attempt": record.attempt},
        )
        return runtime.ready


def _verified_snapshot(identity: AttemptIdentity, stash: dict[str, bytes]) -> AdapterSnapshot:
    """The received adapter, validated, and proven to be the content the version names."""
    try:
        snapshot = AdapterSnapshot.from_blobs(
            json.loads(identity.config_json), identity.plan.blobs(stash)
        )
    except (InvalidAdapterError, KeyError) as exc:
        message = exc.message if isinstance(exc, AgenticLoRAError) else f"missing {exc}"
        raise Refused(Reason.MANIFEST_MISMATCH, message, clean=True) from exc
    if snapshot.digest != identity.digest:
        raise Refused(
            Reason.MANIFEST_MISMATCH,
            f"received adapter hashes to {snapshot.digest[:16]}, "
            f"the version says {identity.digest[:16]}",
            clean=True,
        )
    return snapshot
