"""One progress callback, many listeners.

A :class:`~agentic_lora.assembly.deployment.Deployment` takes a single ``on_progress`` callable for its
publisher and reclaimer. :class:`ProgressHub` is that callable: metrics listen for as long as the
process runs, and a streaming ``POST /admin/publish`` listens for as long as its publication runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from collections.abc import Iterator

from agentic_lora.publication.publisher import PhaseEvent

__all__ = ["ProgressHub", "ProgressListener"]

logger = logging.getLogger(__name__)

#: Receives every publication and reclaim phase event (called on the event loop; must not block).
ProgressListener = Callable[[PhaseEvent], None]


class ProgressHub:
    """Forwards each :class:`~agentic_lora.publication.publisher.PhaseEvent` to every current listener."""

    def __init__(self) -> None:
        self._listeners: list[ProgressListener] = []

    def __call__(self, event: PhaseEvent) -> None:
        # A snapshot of the list: a listener may unsubscribe while being called.
        for listener in tuple(self._listeners):
            try:
                listener(event)
            except Exception:
                # One broken listener must not stop the publication or starve the others.
                logger.exception("progress listener failed", extra={"engine": event.engine})

    def subscribe(self, listener: ProgressListener) -> Callable[[], None]:
        """Add ``listener``; call the returned function to remove it again (idempotent)."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    @contextlib.contextmanager
    def listening(self, listener: ProgressListener) -> Iterator[None]:
        """``with hub.listening(fn):`` subscribes ``fn`` for the block."""
        unsubscribe = self.subscribe(listener)
        try:
            yield
        finally:
            unsubscribe()

    def __len__(self) -> int:
        return len(self._listeners)
