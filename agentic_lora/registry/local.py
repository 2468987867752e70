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

If a write fails, the in-memory state is ahead of the disk: the registry stops (fail-stop) and
every later call raises :class:`~agentic_lora.errors.JournalError`. Restart it to replay the
journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentic_lora.errors import AgenticLoRAError, JournalCorruptError, JournalError
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.journal import Journal, JournalEntry
from agentic_lora.registry.types import (
    RegistryStatus,
    VersionState,
    VersionStatus,
    from_wire,
    to_wire,
)
from agentic_lora.registry.verbs import RegistryVerbs

__all__ = ["LocalRegistry", "RegistryListener"]

logger = logging.getLogger(__name__)

# A queued journal item: a row, a snapshot ``(seq, state)``, or None (a flush marker).
_Item = JournalEntry | tuple[int, dict[str, Any]] | None

#: Called after every applied state change with the verb and its result (not on replays).
RegistryListener = Callable[[str, Any], None]


class LocalRegistry(RegistryVerbs):
    """The LoRA version registry in this process (see module docstring)."""

    def __init__(
        self,
        *,
        engines: Sequence[str],
        capacity: int,
        deployment_epoch: int = 0,
        prefix: str = "policy_lora",
        journal_path: str | Path | None = None,
        group_commit: bool = False,
        compact_every: int = 50_000,
        idempotency_window: int = 16384,
    ) -> None:
        self._core = RegistryCore(
            engines=engines,
            capacity=capacity,
            deployment_epoch=deployment_epoch,
            prefix=prefix,
            idempotency_window=idempotency_window,
        )
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
        if journal_path is not None:
            self._journal = Journal(
                journal_path,
                identity={
                    "deployment_epoch": deployment_epoch,
                    "engines": list(engines),
                    "capacity": capacity,
                    "prefix": prefix,
                },
            )
            self._replay(self._journal)
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

    def add_listener(self, listener: RegistryListener) -> None:
        self._listeners.append(listener)

    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        if self._failed is not None:
            raise JournalError(
                f"registry stopped after a journal write failed: {self._failed!r}"
            ) from self._failed
        if self._closed:
            raise JournalError("registry is closed")
        result, applied = self._core.execute(request_id, verb, args)
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
            for listener in self._listeners:
                try:
                    listener(verb, result)
                except Exception:
                    logger.exception("registry listener failed", extra={"verb": verb})
        return result

    async def _persist(self, entry: JournalEntry) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._queue.append((entry, fut))
        self._since_snapshot += 1
        if self._since_snapshot >= self._compact_every:
            # Queued behind the rows it covers, so it is written only after they are.
            self._queue.append(((self._core.seq, self._core.to_state()), None))
            self._since_snapshot = 0
        if self._writer is None:
            self._wakeup = asyncio.Event()
            self._writer = loop.create_task(self._write_loop(), name="lora-registry-journal")
        assert self._wakeup is not None
        self._wakeup.set()
        await fut

    async def _write_loop(self) -> None:
        assert self._journal is not None
        assert self._wakeup is not None
        journal = self._journal
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                if self._group_commit:
                    batch, self._queue = self._queue, []
                else:
                    batch = [self._queue.pop(0)]
                    # A snapshot never travels alone: it is written right after its rows.
                    while self._queue and isinstance(self._queue[0][0], tuple):
                        batch.append(self._queue.pop(0))
                try:
                    await loop.run_in_executor(self._executor, _write_batch, journal, batch)
                except BaseException as exc:  # fail-stop: memory is now ahead of disk
                    self._failed = exc
                    logger.critical("registry journal write failed; registry stopped", exc_info=exc)
                    for _, fut in batch + self._queue:
                        if fut is not None and not fut.done():
                            fut.set_exception(JournalError(f"journal write failed: {exc!r}"))
                    self._queue.clear()
                    return
                for _, fut in batch:
                    if fut is not None and not fut.done():
                        fut.set_result(None)

    async def aclose(self) -> None:
        """Flush pending journal rows and close the journal (idempotent)."""
        if self._closed:
            return
        if self._writer is not None and not self._writer.done() and self._failed is None:
            # A flush marker queued behind every pending row: resolved once they are durable.
            assert self._wakeup is not None
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append((None, fut))
            self._wakeup.set()
            with contextlib.suppress(JournalError):
                await fut
        self._closed = True
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._journal is not None:
            self._journal.close()

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


def _write_batch(journal: Journal, batch: list[tuple[_Item, asyncio.Future[None] | None]]) -> None:
    rows: list[JournalEntry] = []
    for item, _ in batch:
        if isinstance(item, JournalEntry):
            rows.append(item)
        elif item is not None:
            if rows:
                journal.append(rows)
                rows = []
            journal.write_snapshot(item[0], item[1])
    if rows:
        journal.append(rows)
