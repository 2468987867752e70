"""Session affinity by rendezvous (highest-random-weight) hashing."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from agentic_lora.engines.routing import InFlightCounter

__all__ = ["SessionAffinityRouter", "rendezvous_score"]


def rendezvous_score(session_key: str, engine: str) -> int:
    """A stable pseudo-random weight of (Session, engine); the same in every process."""
    digest = hashlib.blake2b(
        f"{session_key}\x00{engine}".encode(), digest_size=8, person=b"agentic-lora"
    ).digest()
    return int.from_bytes(digest, "big")


@functools.lru_cache(maxsize=4096)
def _heaviest(session_key: str, engines: tuple[str, ...]) -> str:
    # A pure function of its arguments, so a remembered answer is the answer: a Session's every
    # dispatch after its first costs a lookup, not a hash per engine.
    return max(engines, key=lambda e: (rendezvous_score(session_key, e), e))


class SessionAffinityRouter(InFlightCounter):
    """Keeps each Session on one engine while it is healthy.

    Every engine gets a weight per Session; the Session goes to the heaviest of the engines it is
    offered. Taking an engine out of the offer moves only the Sessions that were on it, and
    bringing it back returns exactly those: no other Session ever changes engine, so their prefix
    caches stay warm. Requests without a Session go to the engine with the fewest in flight.
    """

    def choose(
        self, session_key: str | None, engines: Sequence[str], request: Mapping[str, Any]
    ) -> str:
        """The heaviest engine for this Session (fewest in flight without a Session)."""
        if not engines:
            raise ValueError("no engine to choose from")
        if session_key is None:
            return min(engines, key=lambda e: (self.in_flight(e), engines.index(e)))
        return _heaviest(session_key, engines if isinstance(engines, tuple) else tuple(engines))
