"""The registry's idempotency window: the results of recent state-changing calls by request id.

A replay (the reply was lost) gets the original result back instead of running the verb twice. A
call that raised changed nothing, so it is never remembered: replaying it simply runs it again. The
window is a bounded FIFO so memory stays flat; it is part of the registry's snapshot, so a
restarted registry answers a replay exactly as the live one would have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from agentic_lora.errors import InvalidStateError
from agentic_lora.registry.types import RefLookup
from agentic_lora.registry.types import from_wire
from agentic_lora.registry.types import to_wire

__all__ = ["IdempotencyWindow", "fingerprint"]


def fingerprint(args: dict[str, Any]) -> tuple[Any, ...]:
    """A call's identity besides its verb. ``now`` is not part of it (a replay carries a later
    time)."""
    # A list inside tuple(), not a generator: the same values for a fraction of the cost (this
    # runs on every recorded call, a Session's first dispatch among them).
    return tuple([tuple(a) if isinstance(a, list) else a for k, a in args.items() if k != "now"])


class IdempotencyWindow:
    """request_id -> (verb, args fingerprint, result) for the last ``size`` applied calls."""

    __slots__ = ("_done", "_size")

    def __init__(self, size: int) -> None:
        self._size = size
        self._done: OrderedDict[str, tuple[str, tuple[Any, ...], Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._done)

    def recall(self, request_id: str, verb: str, fp: tuple[Any, ...]) -> tuple[bool, Any]:
        """``(True, result)`` if ``request_id`` already ran this call; refuses its reuse for
        another call (a caller bug: two calls would share one reply)."""
        seen = self._done.get(request_id)
        if seen is None:
            return False, None
        if seen[0] != verb or seen[1] != fp:
            raise InvalidStateError(
                f"request id {request_id!r} was already used for another call ({seen[0]})",
                reason="request_id_reused",
                request_id=request_id,
            )
        return True, seen[2]

    def remember(self, request_id: str, verb: str, fp: tuple[Any, ...], result: Any) -> None:
        done = self._done
        done[request_id] = (verb, fp, result)
        if len(done) > self._size:
            done.popitem(last=False)

    def to_state(self) -> list[list[Any]]:
        return [
            [rid, verb, to_wire(list(fp)), to_wire(res)]
            for rid, (verb, fp, res) in self._done.items()
        ]

    def load_state(self, rows: Iterable[Any], known: RefLookup | None = None) -> None:
        """Inverse of :meth:`to_state`; ``known`` completes receipts written without a ref."""
        self._done = OrderedDict(
            (rid, (verb, _freeze(from_wire(fp, known)), from_wire(res, known)))
            for rid, verb, fp, res in rows
        )


def _freeze(value: Iterable[Any]) -> tuple[Any, ...]:
    """Rebuild an args fingerprint (JSON turned its inner tuples into lists)."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in value)
