"""The receiving side of one driver's transfer of one attempt: a thread, a group, a stash.

Collectives block, so each attempt gets a single worker thread of its own: it first joins the
attempt's process group, then runs one receive per armed bucket, strictly in arm order (the order
the publisher broadcasts in). The event loop only queues work and reacts to results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from agentic_lora_dcs.collective import AttemptGroup
from agentic_lora_dcs.plan import BucketPlan, ChecksumMismatch
from agentic_lora_dcs.protocol import ReadyReply

#: A received bucket: its tensors by name, and the ones whose checksum did not match.
Unpacked = tuple[dict[str, bytes], list[ChecksumMismatch]]

__all__ = ["Staging", "Unpacked", "consume_exception"]


class Staging:
    """Resources of one attempt run (dropped as a whole when the attempt leaves the transfer)."""

    def __init__(self, join: Callable[[], AttemptGroup], *, label: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"dcs-{label}"
        )
        # Settled on the attempt's own thread before any receive runs there.
        self._group = self._executor.submit(join)
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

        return asyncio.get_running_loop().run_in_executor(self._executor, run)

    def stash_bytes(self) -> int:
        return sum(len(data) for data in self.stash.values())

    def release(self) -> None:
        """Stop queueing receives and let the group go.

        A receive still blocked in a collective ends when the group times out; nothing waits
        for it, and its bytes are discarded because the attempt has left the transfer.
        """
        self._executor.shutdown(wait=False, cancel_futures=True)
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
