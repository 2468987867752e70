"""Engine incarnations from what an engine does publish (pure bookkeeping, no I/O).

Neither SGLang nor vLLM publishes a process id or boot nonce, so ``incarnation =
<fingerprint>.<generation>``:

* ``fingerprint`` is the engine-specific restart witness the backend reads: for SGLang a hash of
  the process-identifying fields of ``/server_info`` (see
  :data:`agentic_lora.engines.admin.FINGERPRINT_FIELDS`), for vLLM the API server's
  ``process_start_time_seconds``. It changes on every restart and never while the process runs;
* ``generation`` counts, per engine, how often adapters this backend loaded and confirmed (and has
  not started to unload) were found missing from ``/v1/models``. A restarted engine forgets every
  dynamically loaded adapter, so this catches a restart even when the fingerprint cannot (an old
  SGLang without ``startup_time`` and a pinned seed), exactly in the case that matters: an engine
  that lost a version it had reported READY.

Both parts can only move forward within one backend process, so a restart is never mistaken for
the same incarnation; an adapter unloaded behind this backend's back counts as a restart too
(conservative: a READY is dropped and the publication retried, never trusted wrongly).

The same fact makes the listing alone a restart witness while this backend holds an adapter on
the engine: a new process lists none of them. :meth:`IncarnationTracker.unchanged` answers the
known incarnation from a listing that still names every held adapter, so the backend reads the
fingerprint (SGLang's ``/server_info``: a scheduler round trip, ten times the listing's cost)
only when it holds nothing there or one went missing. A missing one is never judged from the
listing alone: the backend then reads the fingerprint and the listing again and
:meth:`~IncarnationTracker.observe` decides, so a listing that raced this backend's own load (read
before the load, checked after the hold) costs one full read, never a false restart.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["IncarnationTracker"]


class IncarnationTracker:
    """Derives incarnations per engine from observations (pure, no I/O)."""

    def __init__(self) -> None:
        self._fingerprint: dict[str, str] = {}
        self._generation: dict[str, int] = {}
        self._held: dict[str, set[str]] = {}

    def observe(self, engine: str, fingerprint: str, listed: Collection[str]) -> str:
        """The incarnation given the engine's fingerprint and the adapter names it lists now."""
        held = self._held.setdefault(engine, set())
        previous = self._fingerprint.get(engine)
        if previous is not None and previous != fingerprint:
            held.clear()  # a new process holds nothing this backend loaded
        self._fingerprint[engine] = fingerprint
        missing = held.difference(listed)
        if missing:
            self._generation[engine] = self._generation.get(engine, 0) + 1
            held.difference_update(missing)
        return f"{fingerprint}.{self._generation.get(engine, 0)}"

    def unchanged(self, engine: str, listed: Collection[str]) -> str | None:
        """The known incarnation if ``listed`` (the engine's adapter names, read now) still names
        every adapter this backend holds there and it holds at least one; else None: the
        fingerprint must be read (see the module docstring). Changes nothing."""
        held = self._held.get(engine)
        fingerprint = self._fingerprint.get(engine)
        if not held or fingerprint is None or not held.issubset(listed):
            return None
        return f"{fingerprint}.{self._generation.get(engine, 0)}"

    def holds_any(self, engine: str) -> bool:
        """Whether this backend holds an adapter on ``engine`` (so a listing can witness a
        restart there)."""
        return bool(self._held.get(engine))

    def hold(self, engine: str, lora_name: str) -> None:
        """``lora_name`` is confirmed loaded on ``engine``; its disappearance means a restart."""
        self._held.setdefault(engine, set()).add(lora_name)

    def release(self, engine: str, lora_name: str) -> None:
        """An unload of ``lora_name`` is starting; from now on its absence is expected."""
        self._held.get(engine, set()).discard(lora_name)
