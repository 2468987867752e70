"""The in-process registry: :class:`RegistryCore` behind the async :class:`RegistryAPI`, with an
optional durable journal.

Without a journal every verb is a plain call into the core (no await inside, so each one is atomic
on the event loop). With a journal, a verb is applied to the core and its row is queued for one
writer, in apply order; the caller gets its answer only once that row is durable. Two durability
modes:

* ``group_commit=False``: one SQLite transaction (one fsync) per state-changing call;
* ``group_commit=True``: the writer takes every row queued while the previous transaction ran and
  commits them together; each caller still waits for its own row to be durable.

Reads (``status``, ``version``, ``peek_version``) may observe a change whose row is still being
written. That is safe for every reader here: nobody acts on such a change before its own
mutating call (which is ordered after it in the journal) comes back durable.

A replayed request id (a retry after a lost reply) is answered from the core's memory, but only
once every change applied so far is durable: the original call's row may still be queued.

If a write fails, the in-memory state is ahead of the disk: the registry stops (fail-stop) and
every later call raises :class:`~agentic_lora.errors.JournalError`; :attr:`LocalRegistry.failed`
holds the cause. Restart it to replay the journal. A caller whose row was committed before the
failure still gets its answer; only callers whose rows were not get the error.

The journal is locked for this registry's lifetime (one writer per journal; a second opener gets
:class:`~agentic_lora.errors.JournalLockedError`). :meth:`LocalRegistry.aclose` refuses new calls,
writes every queued row, and then releases it.

Expiry belongs to the registry host, not to one owner's lease keeper: this registry sweeps every
lease and name tombstone it holds (replayed from the journal or opened since, by any caller),
whether or not its own process ever opens a lease. The sweeper starts with :meth:`LocalRegistry.start`
(a :class:`~agentic_lora.assembly.deployment.Deployment` calls it), or at the first call that
finds the registry holding a lease or a name, and runs until :meth:`LocalRegistry.aclose`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from typing import Unpack

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import JournalCorruptError
from agentic_lora.errors import JournalError
from agentic_lora.foundation.listeners import notify
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.api import RegistryListener
from agentic_lora.registry.core import TIMED_VERBS
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.journal import Journal
from agentic_lora.registry.journal import JournalEntry
from agentic_lora.registry.journal import RegistryIdentity
from agentic_lora.registry.sweeper import Sweeper
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import from_wire
from agentic_lora.registry.types import new_request_id
from agentic_lora.registry.types import to_wire

__all__ = ["LocalRegistry", "RegistryListener"]

logger = logging.getLogger(__name__)

# A queued journal item: a row, a snapshot ``(seq, state)``, or None (a flush marker).
_Item = JournalEntry | tuple[int, dict[str, Any]] | None


class LocalRegistry(RegistryAPI):
    """The LoRA version registry in this process (see module docstring).

    Its identity (``engines``, ``capacity``, ``deployment_epoch``, ``prefix``: see
    :class:`~agentic_lora.registry.journal.RegistryIdentity`) builds its
    :class:`~agentic_lora.registry.core.RegistryCore` and is what a journal at ``journal_path``
    records.

    ``clock`` is the registry host's wall clock (every timed verb is stamped with it);
    ``sweep_interval`` spaces the background expiry sweeps (None: sweep only on request, with
    :meth:`sweep_if_due`); ``sleep`` is what the sweeper waits with between sweeps (tests gate it).
    """

    def __init__(
        self,
        *,
        journal_path: str | Path | None = None,
        group_commit: bool = False,
        compact_every: int = 50_000,
        idempotency_window: int = 16384,
        clock: Callable[[], float] = time.time,
        sweep_interval: float | None = 1.0,
        name_ttl: float = 3600.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        **identity: Unpack[RegistryIdentity],
    ) -> None:
        if not name_ttl > 0:
            raise ValueError("name_ttl must be above 0")
        self._clock = clock
        self._name_ttl = name_ttl
        self._sweeper = Sweeper(self.sweep_if_due, interval=sweep_interval, sleep=sleep)
        self._core = core = RegistryCore(idempotency_window=idempotency_window, **identity)
        self._listeners: list[RegistryListener] = []
        self._journal: Journal | None = None
        self._group_commit = group_commit
        self._compact_every = compact_every
        self._since_snapshot = 0
        self._queue: list[tuple[_Item, asyncio.Future[None] | None]] = []
        self._wakeup: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._resume_pending = False
        # Highest seq whose row is committed; below ``core.seq`` while rows are queued or in flight.
        self._durable_seq = 0
        if journal_path is not None:
            # The core's values, defaults filled in: a journal records all four.
            self._journal = Journal(
                journal_path,
                identity={
                    "deployment_epoch": core.deployment_epoch,
                    "engines": list(core.engines),
                    "capacity": core.capacity,
                    "prefix": core.prefix,
                },
            )
            self._replay(self._journal)
            self._durable_seq = self._core.seq
            # Owners could not renew while this registry was down: their leases get a full TTL
            # from the first call after the restart (a journaled resume_leases, see _call).
            self._resume_pending = bool(self._core.status().leases)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-journal")

    def _replay(self, journal: Journal) -> None:
        recovered = journal.open()
        try:
            if recovered.snapshot is not None:
                self._core.load_state(recovered.snapshot)
            for e in recovered.entries:
                args = from_wire(json.loads(e.args))
                _, applied = self._core.execute(e.request_id, e.verb, args)
                if not applied or self._core.seq != e.seq:
                    raise JournalCorruptError(
                        f"journal entry {e.seq} ({e.verb}) does not replay to the same sequence",
                        seq=e.seq,
                    )
        except AgenticLoRAError as exc:
            journal.close()
            if isinstance(exc, JournalError):
                raise
            raise JournalCorruptError(
                f"journal entry does not replay: {exc}", cause=exc.code
            ) from exc
        except (KeyError, TypeError, ValueError) as exc:
            journal.close()
            raise JournalCorruptError(f"journal does not replay: {exc!r}") from exc
        except BaseException:
            journal.close()  # releases the lock: nothing may keep it after a failed start
            raise
        self._since_snapshot = len(recovered.entries)
        logger.info(
            "registry recovered from journal",
            extra={
                "journal": str(journal.path),
                "seq": self._core.seq,
                "replayed": len(recovered.entries),
            },
        )

    # --- plumbing ------------------------------------------------------------------------------

    @property
    def core(self) -> RegistryCore:
        """The state machine itself (read it; mutate only through the async verbs)."""
        return self._core

    @property
    def failed(self) -> BaseException | None:
        """None while healthy; else the exception that fail-stopped the registry (for readiness)."""
        return self._failed

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` was called: every later call is refused (for readiness)."""
        return self._closed

    def add_listener(self, listener: RegistryListener) -> None:
        self._listeners.append(listener)

    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        if self._failed is not None:
            raise JournalError(
                f"registry stopped after a journal write failed: {self._failed!r}"
            ) from self._failed
        if self._closed:
            raise JournalError("registry is closed")
        if self._resume_pending:
            await self._resume_leases()
            # Start over: the registry may have closed or failed during that await.
            return await self._call(verb, request_id, args)
        if verb in TIMED_VERBS:
            # The registry host's clock, never the caller's: expiry is decided in one place.
            args = {**args, "now": self._clock()}
        try:
            result, applied = self._core.execute(request_id, verb, args)
        finally:
            # The registry host sweeps whatever it holds that can expire (replayed from a journal
            # or opened since, by any caller), whatever this call's own outcome.
            if not self._sweeper.started and self._core.holds_deadlines():
                self._sweeper.ensure()
        if applied:
            if self._journal is not None:
                await self._persist(
                    JournalEntry(
                        self._core.seq,
                        request_id,
                        verb,
                        json.dumps(to_wire(args), separators=(",", ":")),
                    )
                )
            self._tell(verb, result)
        elif self._journal is not None and self._durable_seq < self._core.seq:
            # A replay whose original row may still be queued or being written: answer only
            # once everything applied so far is durable (JournalError if it never will be).
            await self._flush()
        return result

    def close_session_now(self, session_key: str) -> ReleaseResult | None:
        """``begin_close``, ``release`` and ``forget_sessions([session_key])`` as one synchronous
        step, for a Session in this process with nothing left to wait for (see
        :class:`~agentic_lora.registry.api.SessionCloser`). None, with nothing done, when this
        registry cannot answer without waiting (a journal row to make durable) or is stopped or
        closed: then use the verbs.

        No request id is remembered: the caller is in this process, so no reply can be lost and
        nothing replays. Listeners hear the three verbs, as if they had been called one by one.
        """
        if self._journal is not None or self._failed is not None or self._closed:
            return None
        closing, released = self._core.close_session_now(session_key, self._clock())
        if self._listeners:
            self._tell("begin_close", closing)
            self._tell("release", released)
            self._tell("forget_sessions", 1)
        return released

    def _tell(self, verb: str, result: Any) -> None:
        notify(self._listeners, verb, result, logger=logger, what="registry", extra={"verb": verb})

    async def _persist(self, entry: JournalEntry) -> None:
        fut = self._enqueue(entry)
        self._since_snapshot += 1
        if self._since_snapshot >= self._compact_every:
            # Queued behind the rows it covers (no await since), so written only after them.
            self._queue.append(((self._core.seq, self._core.to_state()), None))
            self._since_snapshot = 0
        await fut

    async def _flush(self) -> None:
        """Return once every row queued so far is durable; JournalError if one never will be."""
        await self._enqueue(None)

    def _enqueue(self, item: _Item) -> asyncio.Future[None]:
        # Callers reach here with no await since their own _failed/_closed check, so the writer
        # is running (or not yet started) and will drain this item.
        if self._writer is not None and self._writer.done():
            self._stop(JournalError("the journal writer has stopped"))
            raise JournalError("the journal writer has stopped") from self._failed
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._queue.append((item, fut))
        if self._writer is None:
            self._wakeup = asyncio.Event()
            self._writer = loop.create_task(self._write_loop(), name="lora-registry-journal")
        assert self._wakeup is not None
        self._wakeup.set()
        return fut

    async def _write_loop(self) -> None:
        assert self._journal is not None
        assert self._wakeup is not None
        assert self._executor is not None
        journal, wakeup, executor = self._journal, self._wakeup, self._executor
        try:
            while True:
                if not self._queue:
                    if self._closed:
                        return  # aclose() waits for this: every row queued before it is written
                    await wakeup.wait()
                    wakeup.clear()
                    continue
                batch = self._next_batch()
                written = asyncio.wrap_future(
                    executor.submit(_write_batch, journal, [item for item, _ in batch])
                )
                try:
                    # Shielded: cancelling this task must not detach the batch from its outcome.
                    durable, error = await asyncio.shield(written)
                except asyncio.CancelledError:
                    # The thread still finishes the batch: its callers get its real outcome
                    # when it does, not this cancellation.
                    written.add_done_callback(functools.partial(self._settle_late, batch))
                    raise
                self._settle(batch, durable, error)
                if error is not None:
                    self._stop(error)
                    return
        except asyncio.CancelledError:
            # Cancelled from outside (aclose() never cancels). Nothing will write the rows still
            # queued, nor those of later calls: unless closed and drained, memory is (or would
            # get) ahead of disk, so fail-stop.
            if self._queue or not self._closed:
                self._stop(JournalError("the journal writer was cancelled"))
            raise

    def _next_batch(self) -> list[tuple[_Item, asyncio.Future[None] | None]]:
        if self._group_commit:
            batch, self._queue = self._queue, []
            return batch
        batch = [self._queue.pop(0)]
        # A snapshot never travels alone (it is written right after its rows); a flush marker
        # rides with the row before it.
        while self._queue and not isinstance(self._queue[0][0], JournalEntry):
            batch.append(self._queue.pop(0))
        return batch

    def _settle(
        self,
        batch: list[tuple[_Item, asyncio.Future[None] | None]],
        durable: int,
        error: BaseException | None,
    ) -> None:
        """Answer the first ``durable`` items of ``batch`` (committed); fail the rest with
        ``error``."""
        for i, (item, fut) in enumerate(batch):
            if fut is not None and fut.done():
                continue  # its caller was cancelled
            if i < durable:
                if isinstance(item, JournalEntry):
                    self._durable_seq = max(self._durable_seq, item.seq)
                if fut is not None:
                    fut.set_result(None)
            elif fut is not None:
                err = JournalError(f"journal write failed, row not written: {error!r}")
                err.__cause__ = error
                fut.set_exception(err)

    def _settle_late(
        self,
        batch: list[tuple[_Item, asyncio.Future[None] | None]],
        written: asyncio.Future[tuple[int, BaseException | None]],
    ) -> None:
        if written.cancelled() or written.exception() is not None:
            self._settle(batch, 0, JournalError("the journal write's outcome is unknown"))
        else:
            self._settle(batch, *written.result())

    def _stop(self, exc: BaseException) -> None:
        """Fail-stop: memory is now ahead of disk. Fail every row still queued."""
        if self._failed is None:
            self._failed = exc
            logger.critical(
                "registry journal write failed; registry stopped",
                exc_info=exc,
                extra={"journal": str(self._journal.path) if self._journal else None},
            )
        queued, self._queue = self._queue, []
        for _, fut in queued:
            if fut is not None and not fut.done():
                err = JournalError(f"journal write failed, row not written: {exc!r}")
                err.__cause__ = exc
                fut.set_exception(err)

    async def aclose(self) -> None:
        """Refuse new calls, write every queued row, close the journal and release its lock.

        Every caller still waiting gets the truth: its answer if its row was committed, a
        :class:`JournalError` only if it was not. A journal failure is not raised here (see
        :attr:`failed`). Idempotent; concurrent calls, and a call after an earlier one was
        cancelled, all wait for the same close, which a cancellation does not interrupt.
        """
        if self._closing is None:
            self._closed = True  # from here on _call refuses: nothing new is queued
            self._sweeper.stop()  # a sweep is a call like any other: refused from now on
            self._closing = asyncio.get_running_loop().create_task(
                self._close(), name="lora-registry-close"
            )
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if self._writer is not None and not self._writer.done():
            assert self._wakeup is not None
            self._wakeup.set()  # the writer drains the queue, sees _closed, and returns
            await asyncio.wait([self._writer])  # never cancelled by us: no batch is cut off
        if self._executor is not None:
            # Idle unless the writer was cancelled from outside mid-batch: then this waits for
            # that batch, which must end before the connection closes.
            self._executor.shutdown(wait=True)
        if self._journal is not None:
            self._journal.close()

    # --- lease expiry -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Take up the registry host's duties now: resume the leases a restart replayed (a full
        TTL from now: their owners could not renew while the registry was down) and start the
        expiry sweeper, so every lease and name tombstone this registry holds expires on time
        whether or not any call ever comes. Idempotent; a no-op once closed or stopped."""
        if self._closed or self._failed is not None:
            return
        if self._resume_pending:
            await self._resume_leases()
        self._sweeper.ensure()

    @property
    def sweeping(self) -> bool:
        """Whether the background expiry sweeper runs (for readiness and tests)."""
        return self._sweeper.running

    async def _resume_leases(self) -> None:
        self._resume_pending = False
        await self._call("resume_leases", new_request_id(), {})

    async def sweep_if_due(self) -> SweepResult | None:
        """Run one journaled :meth:`sweep` if some lease or name tombstone is due; else None."""
        if not self._core.sweep_due(self._clock(), self._name_ttl):
            return None
        result = await self.sweep(request_id=new_request_id(), name_ttl=self._name_ttl)
        if result.expired_leases:
            logger.warning(
                "leases expired; their Sessions' refs are released",
                extra={
                    "leases": list(result.expired_leases),
                    "sessions": len(result.expired_sessions),
                },
            )
        return result

    # --- reads ---------------------------------------------------------------------------------

    async def status(self) -> RegistryStatus:
        return self._core.status()

    async def version(self, version_id: str) -> VersionStatus:
        return self._core.version(version_id)

    def peek_version(self, version_id: str) -> VersionStatus | None:
        """Synchronous, I/O-free read of one version (for hot-path dispatch checks)."""
        return self._core.peek_version(version_id)

    def state_of(self, version_id: str) -> VersionState | None:
        """The cheapest read: a version's state, or None if unknown."""
        return self._core.state_of(version_id)


def _write_batch(journal: Journal, items: list[_Item]) -> tuple[int, BaseException | None]:
    """Write ``items`` in order (runs on the writer thread; never raises).

    Returns ``(durable, error)``: ``items[:durable]`` are committed, and ``error`` (None if all
    are) stopped the rest. A batch may take several transactions (rows, snapshot, rows), so a
    failure can come after some of its items are on disk. A flush marker counts as committed
    once everything before it is. A failed COMMIT counts as not committed.
    """
    durable = 0
    rows: list[JournalEntry] = []
    try:
        for i, item in enumerate(items):
            if isinstance(item, JournalEntry):
                rows.append(item)
            elif item is None:
                if not rows:
                    durable = i + 1
            else:
                if rows:
                    journal.append(rows)
                    rows = []
                durable = i
                journal.write_snapshot(item[0], item[1])
                durable = i + 1
        if rows:
            journal.append(rows)
    except BaseException as exc:
        return durable, exc
    return len(items), None
