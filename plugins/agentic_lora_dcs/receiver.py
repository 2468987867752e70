"""The receiver half of a staged transfer: what a sidecar does with each control message.

It runs beside one engine. For every attempt it keeps a stash of received buckets and one worker
thread that joins the attempt's process group and then receives buckets in plan order (the
collectives block; the event loop never does). The decisions (stale, fenced, duplicate) come from
:class:`~agentic_lora_dcs.attempts.Ledger`; this module executes them: it arms collectives,
verifies bytes, materialises the immutable adapter directory through
:class:`~agentic_lora.store.AdapterStore` and loads it (pinned) through
:class:`~agentic_lora.engine_admin.EngineAdminClient`.

Incarnation is ``<sidecar boot id>/<engine fingerprint>``: it changes when either process
restarts, and every attempt message names the incarnation it was meant for, so a message that
crossed a restart is refused instead of acting on state it never saw.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, TypeVar

from agentic_lora.adapter import AdapterSnapshot
from agentic_lora.engine_admin import LoadResult, ProbeResult, ServerInfo, UnloadOutcome
from agentic_lora.errors import (
    AgenticLoRAError,
    BackendAmbiguousError,
    BackendRefusedError,
    InvalidAdapterError,
    VersionConflictError,
)
from agentic_lora_dcs.attempts import (
    AttemptIdentity,
    AttemptRecord,
    AttemptState,
    BeginDecision,
    BucketDecision,
    EndDecision,
    Ledger,
    Refused,
)
from agentic_lora_dcs.collective import (
    SUPPORTED_BACKENDS,
    AttemptGroup,
    CollectiveCounter,
    RendezvousServer,
)
from agentic_lora_dcs.manifest import manifest_digest, name_matches
from agentic_lora_dcs.protocol import (
    PROTOCOL_VERSION,
    AttemptView,
    BeginReply,
    BeginRequest,
    BucketReply,
    BucketRequest,
    CleanupReply,
    CleanupRequest,
    EndRequest,
    IncarnationReply,
    ReadyReply,
    Reason,
    ReclaimOutcome,
    ReclaimReply,
    ReclaimRequest,
    Rendezvous,
    StatusReply,
)
from agentic_lora_dcs.staging import Staging, Unpacked, consume_exception

__all__ = ["AdapterDirectories", "EngineControl", "Receiver"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_K = TypeVar("_K")


class EngineControl(Protocol):
    """What the receiver needs from its engine (``EngineAdminClient`` provides it)."""

    async def server_info(self) -> ServerInfo: ...

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, pinned: bool = True
    ) -> LoadResult: ...

    async def unload_lora_adapter(self, lora_name: str) -> UnloadOutcome: ...

    async def probe_generate(self, lora_name: str) -> ProbeResult: ...

    async def list_lora_adapters(self) -> dict[str, str]: ...


class AdapterDirectories(Protocol):
    """Where verified adapters are materialised (``AdapterStore`` provides it)."""

    async def put(self, lora_name: str, snapshot: AdapterSnapshot) -> Path: ...

    async def remove(self, lora_name: str) -> bool: ...

    def path_for(self, lora_name: str) -> Path: ...


class Receiver:
    """One sidecar's state and verbs (the HTTP layer in :mod:`agentic_lora_dcs.sidecar` is thin)."""

    def __init__(
        self,
        *,
        engine: EngineControl,
        store: AdapterDirectories,
        rendezvous: RendezvousServer,
        collective_timeout: datetime.timedelta,
        probe: bool = True,
        sidecar_id: str | None = None,
        backends: tuple[str, ...] = SUPPORTED_BACKENDS,
    ) -> None:
        self.sidecar_id = sidecar_id or uuid.uuid4().hex[:16]
        self.counter = CollectiveCounter()
        self._engine = engine
        self._store = store
        self._rendezvous = rendezvous
        self._timeout = collective_timeout
        self._probe = probe
        self._backends = backends
        self._ledger = Ledger()
        self._runtimes: dict[tuple[str, int, str], Staging] = {}
        self._cleanups: dict[tuple[str, int], asyncio.Task[CleanupReply]] = {}
        self._reclaims: dict[str, asyncio.Task[ReclaimReply]] = {}

    @property
    def rendezvous_port(self) -> int:
        """The port of the TCPStore the attempts' process groups rendezvous on."""
        return self._rendezvous.port

    # --- incarnation ----------------------------------------------------------------------------

    async def engine_incarnation(self) -> str:
        """The engine's process fingerprint (changes on every engine restart)."""
        info = await self._engine.server_info()
        return info.fingerprint

    async def incarnation(self) -> IncarnationReply:
        engine_inc = await self.engine_incarnation()
        return IncarnationReply(
            incarnation=f"{self.sidecar_id}/{engine_inc}",
            sidecar_id=self.sidecar_id,
            engine_incarnation=engine_inc,
            protocol=PROTOCOL_VERSION,
            backends=self._backends,
        )

    def _check_sidecar(self, claimed: str, *, clean: bool) -> None:
        # Cheap check for the hot path: the sidecar part of the incarnation, no engine call.
        # Records live in one sidecar incarnation, so a message naming another one finds nothing
        # here; ``clean`` says whether the attempt could have loaded anything by that message.
        if claimed.partition("/")[0] != self.sidecar_id:
            raise Refused(
                Reason.INCARNATION_MISMATCH,
                f"message for sidecar {claimed.partition('/')[0]}, this is {self.sidecar_id}",
                clean=clean,
            )

    @staticmethod
    def _check_attempt_incarnation(claimed: str, record: AttemptRecord | None) -> None:
        if record is None or record.identity is None or record.identity.incarnation == claimed:
            return
        raise Refused(
            Reason.INCARNATION_MISMATCH,
            f"attempt {record.attempt} began under {record.identity.incarnation}, not {claimed}",
            clean=not record.state.may_hold_engine and record.state is not AttemptState.PREPARED,
        )

    # --- begin ----------------------------------------------------------------------------------

    async def begin(self, req: BeginRequest) -> BeginReply:
        """Fix the attempt's identity and plan, and start joining its process group."""
        if req.protocol != PROTOCOL_VERSION:
            raise Refused(
                Reason.PROTOCOL_MISMATCH,
                f"protocol {req.protocol}, this sidecar speaks {PROTOCOL_VERSION}",
                clean=True,
            )
        if req.backend not in self._backends:
            raise Refused(
                Reason.UNSUPPORTED_BACKEND,
                f"collective backend {req.backend!r} not available here ({self._backends})",
                clean=True,
            )
        try:
            current = (await self.incarnation()).incarnation
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            raise Refused(Reason.ENGINE_UNAVAILABLE, exc.message, clean=True) from exc
        if req.incarnation != current:
            # Nothing of an attempt exists before its Begin is accepted: always clean.
            raise Refused(
                Reason.INCARNATION_MISMATCH,
                f"begin for incarnation {req.incarnation}, this is {current}",
                clean=True,
                current=current,
            )
        self._check_identity(req)
        identity = AttemptIdentity(
            version_id=req.version_id,
            digest=req.digest,
            backend=req.backend,
            config_json=json.dumps(req.config, sort_keys=True, separators=(",", ":")),
            plan=req.plan,
            incarnation=req.incarnation,
            driver=req.driver,
        )
        # Decided after the awaits above: nothing can interleave between decision and effect.
        decision, record, superseded = self._ledger.begin(req.lora_name, req.attempt, identity)
        for old in superseded:
            self._drop(old, why="retired by a newer Begin")
        if decision is BeginDecision.NEW:
            self._start_runtime(record, req.backend)
            logger.info(
                "begin %s attempt %d: %d buckets, %d bytes",
                req.lora_name,
                req.attempt,
                len(req.plan.buckets),
                req.plan.total_bytes,
                extra={"version": req.lora_name, "attempt": req.attempt},
            )
        return BeginReply(
            lora_name=req.lora_name,
            attempt=req.attempt,
            state=str(record.state),
            duplicate=decision is BeginDecision.DUPLICATE,
            rendezvous=self._rendezvous_for(record),
        )

    def _check_identity(self, req: BeginRequest) -> None:
        if not req.plan.is_canonical():
            raise Refused(
                Reason.BAD_PLAN, "the plan is not the canonical packing of its entries", clean=True
            )
        if not name_matches(req.lora_name, req.version_id, req.digest):
            raise Refused(
                Reason.MANIFEST_MISMATCH,
                f"{req.lora_name} does not name version {req.version_id} / {req.digest[:16]}",
                clean=True,
            )
        try:
            declared = manifest_digest(req.config, req.plan)
        except AgenticLoRAError as exc:
            raise Refused(Reason.MANIFEST_MISMATCH, exc.message, clean=True) from exc
        if declared != req.digest:
            raise Refused(
                Reason.MANIFEST_MISMATCH,
                f"config + manifest hash to {declared[:16]}, the version says {req.digest[:16]}",
                clean=True,
                declared=declared,
            )

    def _rendezvous_for(self, record: AttemptRecord) -> Rendezvous:
        return Rendezvous(
            host=self._rendezvous.host,
            port=self._rendezvous.port,
            prefix=_group_prefix(record),
            timeout_s=self._timeout.total_seconds(),
        )

    def _start_runtime(self, record: AttemptRecord, backend: str) -> None:
        def join() -> AttemptGroup:
            return AttemptGroup.join(
                store=self._rendezvous.store,
                prefix=_group_prefix(record),
                rank=1,
                backend=backend,
                local_host=self._rendezvous.host,
                timeout=self._timeout,
                label=(record.lora_name, record.attempt),
                counter=self.counter,
            )

        self._runtimes[_key(record)] = Staging(join, label=str(record.attempt))

    # --- bucket ---------------------------------------------------------------------------------

    async def bucket(self, req: BucketRequest) -> BucketReply:
        """Arm the collective for (attempt, index) once; a duplicate answers from the record."""
        # Nothing is loaded before End, so a bucket that crossed a sidecar restart is clean.
        self._check_sidecar(req.incarnation, clean=True)
        record = self._ledger.get(req.lora_name, req.attempt)
        self._check_attempt_incarnation(req.incarnation, record)
        if req.index > 0 and record is not None and record.state is AttemptState.PREPARED:
            # Bucket i+1 starts only after bucket i arrived and matched its checksums, so a bad
            # bucket fails the attempt before the publisher sends another byte.
            await self._settle_receive(record, req.index - 1)
        try:
            decision, record, state = self._ledger.bucket(req.lora_name, req.attempt, req.index)
        except Refused as refused:
            self._fail_on_violation(record, refused)
            raise
        if decision is BucketDecision.ARM:
            self._arm(record, req.index)
        return BucketReply(
            lora_name=req.lora_name,
            attempt=req.attempt,
            index=req.index,
            state=state,
            duplicate=decision is BucketDecision.DUPLICATE,
        )

    def _fail_on_violation(self, record: AttemptRecord | None, refused: Refused) -> None:
        # A clean refusal of the current attempt's own message (out of order, outside the plan,
        # End too early) promises the attempt holds nothing: drop its stash to keep that true.
        if (
            refused.clean
            and refused.reason in _VIOLATIONS
            and record is not None
            and record.state is AttemptState.PREPARED
        ):
            self._fail(record, refused.reason)

    def _arm(self, record: AttemptRecord, index: int) -> None:
        assert record.identity is not None
        runtime = self._runtimes[_key(record)]
        raw = runtime.receive(index, record.identity.plan)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        runtime.receives[index] = done
        raw.add_done_callback(lambda fut: self._on_received(record, runtime, index, fut, done))

    def _on_received(
        self,
        record: AttemptRecord,
        runtime: Staging,
        index: int,
        fut: asyncio.Future[Unpacked],
        done: asyncio.Future[None],
    ) -> None:
        if runtime.dropped or record.state not in _RECEIVING:
            # The attempt was cleaned up, failed or retired while the bytes were in flight.
            consume_exception(fut)
            _settle(done, Refused(Reason.FENCED, "attempt dropped during receive", clean=True))
            return
        if fut.cancelled() or fut.exception() is not None:
            exc = fut.exception() if not fut.cancelled() else None
            logger.warning(
                "bucket %d of %s attempt %d: collective failed: %r",
                index,
                record.lora_name,
                record.attempt,
                exc,
                extra={"version": record.lora_name, "attempt": record.attempt},
            )
            self._fail(record, Reason.TRANSPORT_FAILED)
            _settle(
                done, Refused(Reason.TRANSPORT_FAILED, f"collective failed: {exc!r}", clean=True)
            )
            return
        tensors, mismatches = fut.result()
        if mismatches:
            first = mismatches[0]
            self._fail(record, Reason.CHECKSUM_MISMATCH)
            _settle(
                done,
                Refused(
                    Reason.CHECKSUM_MISMATCH,
                    f"bucket {index}: tensor {first.tensor} hashes to {first.actual[:16]}, "
                    f"manifest says {first.expected[:16]}",
                    clean=True,
                    tensors=[m.tensor for m in mismatches],
                ),
            )
            return
        runtime.stash.update(tensors)
        record.received += 1
        _settle(done, None)

    async def _settle_receive(self, record: AttemptRecord, index: int) -> None:
        runtime = self._runtimes.get(_key(record))
        pending = None if runtime is None else runtime.receives.get(index)
        if pending is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(pending), self._timeout.total_seconds())
        except TimeoutError:
            self._fail(record, Reason.TRANSPORT_FAILED)
            raise Refused(
                Reason.TRANSPORT_FAILED, f"bucket {index} was not received in time", clean=True
            ) from None

    # --- end ------------------------------------------------------------------------------------

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
        runtime = self._runtimes[_key(record)]
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
            current = f"{self.sidecar_id}/{await self.engine_incarnation()}"
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
        current = f"{self.sidecar_id}/{await self.engine_incarnation()}"
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
            after = f"{self.sidecar_id}/{await self.engine_incarnation()}"
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

    # --- cleanup --------------------------------------------------------------------------------

    async def cleanup(self, req: CleanupRequest) -> CleanupReply:
        """Make sure nothing of this attempt remains; concurrent duplicates share one run."""
        key = (req.lora_name, req.attempt)
        return await self._coalesce(self._cleanups, key, lambda: self._run_cleanup(req))

    async def _run_cleanup(self, req: CleanupRequest) -> CleanupReply:
        record = self._ledger.get(req.lora_name, req.attempt)
        runtime = None if record is None else self._runtimes.get(_key(record))
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
            runtime = self._runtimes.get(_key(record))
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

    # --- status / lifecycle ---------------------------------------------------------------------

    def status(self) -> StatusReply:
        views = tuple(
            AttemptView(
                lora_name=r.lora_name,
                attempt=r.attempt,
                state=str(r.state),
                buckets_armed=r.armed,
                buckets_received=r.received,
                collectives=self.counter.of(r.lora_name, r.attempt),
                drivers=len(r.drivers),
            )
            for r in self._ledger
        )
        return StatusReply(
            sidecar_id=self.sidecar_id,
            collectives_total=self.counter.total,
            attempts=views,
            reclaimed=self._ledger.reclaimed_names(),
        )

    def stash_bytes(self) -> int:
        """Bytes held in stashes right now (0 once every attempt ended or was dropped)."""
        return sum(runtime.stash_bytes() for runtime in self._runtimes.values())

    async def aclose(self) -> None:
        for task in [*self._cleanups.values(), *self._reclaims.values()]:
            task.cancel()
        for runtime in self._runtimes.values():
            if runtime.end_task is not None and not runtime.end_task.done():
                runtime.end_task.cancel()
            runtime.release()
        self._runtimes.clear()

    # --- helpers --------------------------------------------------------------------------------

    def _fail(self, record: AttemptRecord, reason: Reason) -> None:
        if record.state in (AttemptState.PREPARED, AttemptState.LOADING):
            record.failure = reason
            record.move_to(AttemptState.FAILED)
            self._drop(record, why=str(reason))

    def _uncertain(self, record: AttemptRecord) -> None:
        if record.state is AttemptState.LOADING:
            record.move_to(AttemptState.UNCERTAIN)
        runtime = self._runtimes.get(_key(record))
        if runtime is not None:
            runtime.stash.clear()
            runtime.release()

    def _drop(self, record: AttemptRecord, *, why: str) -> None:
        runtime = self._runtimes.get(_key(record))
        if runtime is None or runtime.dropped:
            return
        runtime.drop()
        if runtime.end_task is None or runtime.end_task.done():
            self._runtimes.pop(_key(record), None)
        logger.info(
            "dropped %s attempt %d (%s)",
            record.lora_name,
            record.attempt,
            why,
            extra={"version": record.lora_name, "attempt": record.attempt},
        )

    def _forget_if_dropped(self, record: AttemptRecord) -> None:
        # An attempt that failed inside its own End keeps its runtime until the End settles.
        runtime = self._runtimes.get(_key(record))
        if runtime is not None and runtime.dropped:
            del self._runtimes[_key(record)]

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


# Clean refusals of an attempt's own malformed sequence: the attempt is failed and dropped.
_VIOLATIONS = (Reason.OUT_OF_ORDER, Reason.BAD_BUCKET, Reason.INCOMPLETE)

# End moves an attempt to LOADING while its last bucket may still be arriving.
_RECEIVING = (AttemptState.PREPARED, AttemptState.LOADING)


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


def _key(record: AttemptRecord) -> tuple[str, int, str]:
    # Runtimes belong to one driver's run of an attempt; a takeover gets fresh ones.
    return (
        record.lora_name,
        record.attempt,
        "" if record.identity is None else record.identity.driver,
    )


def _group_prefix(record: AttemptRecord) -> str:
    assert record.identity is not None
    return f"{record.lora_name}/{record.attempt}/{record.identity.driver}"


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
        fut.add_done_callback(consume_exception)
