"""The receiver half of a staged transfer: what a sidecar does with each control message.

It runs beside one engine. For every attempt it keeps a stash of received buckets and one worker
thread that joins the attempt's process group and then receives buckets in plan order (the
collectives block; the event loop never does). The decisions (stale, fenced, duplicate) come from
:class:`~agentic_lora_dcs.attempts.Ledger`; this module executes them: it arms collectives,
verifies bytes, materialises the immutable adapter directory through
:class:`~agentic_lora.adapters.store.AdapterStore` and loads it (pinned) through
:class:`~agentic_lora.engines.admin.EngineAdminClient`.

Incarnation is ``<sidecar boot id>/<engine fingerprint>``: it changes when either process
restarts, and every attempt message names the incarnation it was meant for, so a message that
crossed a restart is refused instead of acting on state it never saw.

The verbs are split by job: begin and bucket are here, End in :mod:`agentic_lora_dcs.loading`,
cleanup and reclaim in :mod:`agentic_lora_dcs.teardown`, and the state they share in
:mod:`agentic_lora_dcs.receiver_state`.
"""

from __future__ import annotations

import asyncio
import json
import logging

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora_dcs.attempts import AttemptIdentity
from agentic_lora_dcs.attempts import AttemptRecord
from agentic_lora_dcs.attempts import AttemptState
from agentic_lora_dcs.attempts import BeginDecision
from agentic_lora_dcs.attempts import BucketDecision
from agentic_lora_dcs.attempts import Refused
from agentic_lora_dcs.collective import SUPPORTED_BACKENDS
from agentic_lora_dcs.collective import AttemptGroup
from agentic_lora_dcs.loading import LoadSteps
from agentic_lora_dcs.manifest import manifest_digest
from agentic_lora_dcs.manifest import name_matches
from agentic_lora_dcs.protocol import PROTOCOL_VERSION
from agentic_lora_dcs.protocol import BeginReply
from agentic_lora_dcs.protocol import BeginRequest
from agentic_lora_dcs.protocol import BucketReply
from agentic_lora_dcs.protocol import BucketRequest
from agentic_lora_dcs.protocol import Reason
from agentic_lora_dcs.protocol import Rendezvous
from agentic_lora_dcs.receiver_state import runtime_key
from agentic_lora_dcs.staging import Staging
from agentic_lora_dcs.staging import Unpacked
from agentic_lora_dcs.staging import consume_exception
from agentic_lora_dcs.teardown import TeardownSteps

__all__ = ["Receiver"]

logger = logging.getLogger(__name__)


class Receiver(LoadSteps, TeardownSteps):
    """One sidecar's state and verbs (the HTTP layer in :mod:`agentic_lora_dcs.sidecar` is thin)."""

    # --- begin ----------------------------------------------------------------------------------

    async def begin(self, req: BeginRequest) -> BeginReply:
        """Fix the attempt's identity and plan, and start joining its process group."""
        if req.protocol != PROTOCOL_VERSION:
            raise Refused(
                Reason.PROTOCOL_MISMATCH,
                f"protocol {req.protocol}, this sidecar speaks {PROTOCOL_VERSION}",
                clean=True,
            )
        if req.backend not in SUPPORTED_BACKENDS:
            raise Refused(
                Reason.UNSUPPORTED_BACKEND,
                f"collective backend {req.backend!r} not available here ({SUPPORTED_BACKENDS})",
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

        self._runtimes[runtime_key(record)] = Staging(join, label=str(record.attempt))

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

    def _arm(self, record: AttemptRecord, index: int) -> None:
        assert record.identity is not None
        runtime = self._runtimes[runtime_key(record)]
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


# End moves an attempt to LOADING while its last bucket may still be arriving.
_RECEIVING = (AttemptState.PREPARED, AttemptState.LOADING)


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
