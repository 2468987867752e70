"""Which attempt of a name may still act on one engine (pure bookkeeping, no I/O).

A retry reuses the immutable lora name (name = version + digest), so the engine cannot tell an
old attempt's messages from a newer attempt's. The fences below make that distinction here:

* a cleanup of attempt *k* records "cleaned up to *k*"; a prepare of attempt *k* (or older) that
  arrives after it (a cleanup that overtook its prepare) is refused, so it never loads anything;
* a prepare of attempt *k* records "prepared up to *k*"; a cleanup of an older attempt that arrives
  late is stale and does nothing, so it never unloads what the newer attempt loaded;
* a reclaim fences every attempt up to the newest one this process prepared or cleaned for the
  name: a late prepare of the reclaimed attempt never loads it again. Only a strictly newer
  attempt may: a rollback's reload of the version, which the registry numbers above every attempt
  before it (and which loads the very same content under the same name).

The fences live in the backend's process; they cover duplicates and reordering among the calls it
makes, not calls made by another process.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AttemptFences", "Verdict"]


class Verdict(enum.StrEnum):
    """What a fence says about one prepare or cleanup."""

    GO = "GO"
    FENCED = "FENCED"  # prepare after its cleanup, or of a reclaimed attempt: refuse, touch nothing
    STALE = "STALE"  # cleanup of an attempt a newer one superseded: confirm, touch nothing


@dataclass(slots=True)
class _Marks:
    prepared: int = 0
    cleaned: int = 0
    reclaimed: int = 0  # attempts up to this one are reclaimed (0: none)


class AttemptFences:
    """Per (engine, lora name) attempt marks."""

    def __init__(self) -> None:
        self._marks: dict[tuple[str, str], _Marks] = {}

    def _get(self, engine: str, lora_name: str) -> _Marks:
        return self._marks.setdefault((engine, lora_name), _Marks())

    def begin_prepare(self, engine: str, lora_name: str, attempt: int) -> Verdict:
        """Admit a prepare of ``attempt`` (and record it) or fence it."""
        marks = self._get(engine, lora_name)
        if attempt <= marks.reclaimed or attempt <= marks.cleaned or attempt < marks.prepared:
            return Verdict.FENCED
        marks.prepared = attempt
        return Verdict.GO

    def begin_cleanup(self, engine: str, lora_name: str, attempt: int) -> Verdict:
        """Admit a cleanup of ``attempt`` (and record it) or call it stale."""
        marks = self._get(engine, lora_name)
        if attempt < marks.prepared:
            return Verdict.STALE
        marks.cleaned = max(marks.cleaned, attempt)
        return Verdict.GO

    def mark_reclaimed(self, engine: str, lora_name: str) -> None:
        """Fence every attempt of ``lora_name`` on ``engine`` this process has seen (at least the
        first): only a newer attempt, a rollback's reload, may load it again."""
        marks = self._get(engine, lora_name)
        marks.reclaimed = max(marks.reclaimed, marks.prepared, marks.cleaned, 1)
