"""The receiving side of one driver's transfer of one attempt: a thread, a group, a stash.

Collectives block, so each attempt gets a single worker thread of its own: it first joins the
attempt's process group, then runs one receive per armed bucket, strictly in arm order (the order
the publisher broadcasts in). The event loop only queues work and reacts to results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from agentic_lora_dcs.collective import AttemptGroup
from agentic_lora_dcs.plan import BucketPlan
from agentic_lora_dcs.plan import ChecksumMismatch
from agentic_lora_dcs.protocol import ReadyReply

#: A received bucket: its tensors by name, and the ones whose checksum did not match.
Unpacked = tuple[dict[str, bytes], list[ChecksumMismatch]]

__all__ = ["Staging", "Unpacked", "consume_exception"]

_T = TypeVar("_T")


class _Worker:
    """One daemon thread running submitted calls in order.

    Not a ThreadPoolExecutor on purpose: its threads are joined at interpreter exit, and a
    receive left blocked in a collective would hold a stopping sidecar until the group timeout.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self._closed:
            future.cancel()
            return future

        def job() -> None:
            if self._closed:
                future.cancel()  # queued before close, never started: it will not run
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._jobs.put(job)
        return future

    def close(self) -> None:
        """Run nothing more (queued calls are cancelled); the thread ends after its current one."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)


class Staging:
    """Resources of one attempt run (dropped as a whole when the attempt leaves the transfer)."""

    def __init__(self, join: Callable[[], AttemptGroup], *, label: str) -> None:
        self._worker = _Worker(f"dcs-{label}")
        # Settled on the attempt's own thread before any receive runs there.
        self._group = self._worker.submit(join)
        # A join that fails is reported by the first receive that needs the group.
        self._group.add_done_callback(consume_exception)
        #: Per armed bucket index: settles once its bytes arrived and were checked.
        self.receives: dict[int, asyncio.Future[None]] = {}
        #: Received tensors by name, until End turns them into a snapshot.
        self.stash: dict[str, bytes] = {}
        self.end_task: asyncio.Task[ReadyReply] | None = None
        self.ready: ReadyReply | None = None
        self.dropped = False

    def receive(self, index: int, plan: BucketPlan) -> asyncio.Future[Unpacked]:
        """Queue the receive of bucket ``index`` (after the join and every earlier receive).

        The bytes are split and checksummed on the attempt's thread too, so a large bucket never
        stalls the event loop that answers the other control messages.
        """
        group = self._group
        nbytes = plan.buckets[index].nbytes

        def run() -> Unpacked:
            # Same thread as the join, so the join has settled (or raised) by now.
            data = group.result(timeout=0).receive(nbytes)
            return plan.unpack(index, data)

        return asyncio.wrap_future(self._worker.submit(run))

    def stash_bytes(self) -> int:
        return sum(len(data) for data in self.stash.values())

    def release(self) -> None:
        """Stop queueing receives and let the group go.

        A receive still blocked in a collective ends when the group times out; nothing waits
        for it, and its bytes are discarded because the attempt has left the transfer.
        """
        self._worker.close()
        group = self._group
        if group.done() and not group.cancelled() and group.exception() is None:
            group.result().close()

    def drop(self) -> None:
        """Release everything this attempt run holds."""
        self.dropped = True
        self.stash.clear()
        self.release()


def consume_exception(fut: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    """Mark a future's exception as retrieved (its owner reports failures another way)."""
    if not fut.cancelled():
        fut.exception()
