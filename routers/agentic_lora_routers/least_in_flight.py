"""Least requests in flight."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from agentic_lora.engines.routing import InFlightCounter

__all__ = ["LeastInFlightRouter"]


class LeastInFlightRouter(InFlightCounter):
    """Sends each dispatch to the engine with the fewest requests in flight.

    Ties are broken in turn (the tie-break start moves one engine per choice), so an idle fleet
    is filled evenly rather than always from its first engine.
    """

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def choose(
        self, session_key: str | None, engines: Sequence[str], request: Mapping[str, Any]
    ) -> str:
        """The engine with the fewest in flight; ties go round the fleet."""
        if not engines:
            raise ValueError("no engine to choose from")
        n = len(engines)
        start = self._turn % n
        self._turn += 1
        order = [engines[(start + i) % n] for i in range(n)]
        return min(order, key=self.in_flight)
