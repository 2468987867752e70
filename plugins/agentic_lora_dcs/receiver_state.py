"""What every verb of a receiver shares: its engine, store, ledger and per-attempt runtimes.

:class:`ReceiverState` holds that state and the steps more than one verb takes: the incarnation
checks every attempt message passes, waiting for one bucket's receive, and failing, marking
uncertain or dropping an attempt. The verbs themselves live in :mod:`agentic_lora_dcs.receiver`
(begin, bucket), :mod:`agentic_lora_dcs.loading` (end) and :mod:`agentic_lora_dcs.teardown`
(cleanup, reclaim).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import uuid
from pathlib import Path
from typing import Protocol

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.admin import LoadResult
from agentic_lora.engines.admin import ProbeResult
from agentic_lora.engines.admin import ServerInfo
from agentic_lora.engines.admin import UnloadOutcome
from agentic_lora_dcs.attempts import AttemptRecord
from agentic_lora_dcs.attempts import AttemptState
from agentic_lora_dcs.attempts import Ledger
from agentic_lora_dcs.attempts import Refused
from agentic_lora_dcs.collective import SUPPORTED_BACKENDS
from agentic_lora_dcs.collective import CollectiveCounter
from agentic_lora_dcs.collective import RendezvousServer
from agentic_lora_dcs.protocol import PROTOCOL_VERSION
from agentic_lora_dcs.protocol import AttemptView
from agentic_lora_dcs.protocol import CleanupReply
from agentic_lora_dcs.protocol import IncarnationReply
from agentic_lora_dcs.protocol import Reason
from agentic_lora_dcs.protocol import ReclaimReply
from agentic_lora_dcs.protocol import StatusReply
from agentic_lora_dcs.staging import Staging

__all__ = ["AdapterDirectories", "EngineControl", "ReceiverState", "runtime_key"]

logger = logging.getLogger(__name__)


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


class ReceiverState:
    """One sidecar's state, and the steps its verbs share."""

    def __init__(
        self,
        *,
        engine: EngineControl,
        store: AdapterDirectories,
        rendezvous: RendezvousServer,
        collective_timeout: datetime.timedelta,
        probe: bool = True,
    ) -> None:
        # A fresh id per boot: an incarnation minted before a sidecar restart never matches.
        self.sidecar_id = uuid.uuid4().hex[:16]
        self.counter = CollectiveCounter()
        self._engine = engine
        self._store = store
        self._rendezvous = rendezvous
        self._timeout = collective_timeout
        self._probe = probe
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

    async def current_incarnation(self) -> str:
        """This sidecar's incarnation as of now: ``<sidecar id>/<engine fingerprint>``."""
        return f"{self.sidecar_id}/{await self.engine_incarnation()}"

    async def incarnation(self) -> IncarnationReply:
        engine_inc = await self.engine_incarnation()
        return IncarnationReply(
            incarnation=f"{self.sidecar_id}/{engine_inc}",
            sidecar_id=self.sidecar_id,
            engine_incarnation=engine_inc,
            protocol=PROTOCOL_VERSION,
            backends=SUPPORTED_BACKENDS,
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

    async def _settle_receive(self, record: AttemptRecord, index: int) -> None:
        runtime = self._runtimes.get(runtime_key(record))
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
        runtime = self._runtimes.get(runtime_key(record))
        if runtime is not None:
            runtime.stash.clear()
            runtime.release()

    def _drop(self, record: AttemptRecord, *, why: str) -> None:
        runtime = self._runtimes.get(runtime_key(record))
        if runtime is None or runtime.dropped:
            return
        runtime.drop()
        if runtime.end_task is None or runtime.end_task.done():
            self._runtimes.pop(runtime_key(record), None)
        logger.info(
            "dropped %s attempt %d (%s)",
            record.lora_name,
            record.attempt,
            why,
            extra={"version": record.lora_name, "attempt": record.attempt},
        )

    def _forget_if_dropped(self, record: AttemptRecord) -> None:
        # An attempt that failed inside its own End keeps its runtime until the End settles.
        runtime = self._runtimes.get(runtime_key(record))
        if runtime is not None and runtime.dropped:
            del self._runtimes[runtime_key(record)]


# Clean refusals of an attempt's own malformed sequence: the attempt is failed and dropped.
_VIOLATIONS = (Reason.OUT_OF_ORDER, Reason.BAD_BUCKET, Reason.INCOMPLETE)


def runtime_key(record: AttemptRecord) -> tuple[str, int, str]:
    """The key of ``record``'s runtime."""
    # Runtimes belong to one driver's run of an attempt; a takeover gets fresh ones.
    return (
        record.lora_name,
        record.attempt,
        "" if record.identity is None else record.identity.driver,
    )
