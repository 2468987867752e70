"""The fixed fleet: the engines a deployment publishes to, named once and never changed."""

from __future__ import annotations

from collections.abc import Sequence

from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import ConfigurationError

__all__ = ["fixed_fleet"]


def fixed_fleet(engines: Sequence[EngineRef]) -> tuple[EngineRef, ...]:
    """The fixed fleet a publisher, reclaimer or repairer drives: non-empty, distinct names.

    Distinct names matter because every registry receipt is keyed by engine name: two refs
    with one name would let one engine's READY stand for the other's.
    """
    names = [e.name for e in engines]
    if not names or len(set(names)) != len(names):
        raise ConfigurationError(f"the fleet needs distinct engines, got {names}", engines=names)
    return tuple(engines)
