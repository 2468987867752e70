"""Telling listeners about an event: one broken listener never stops the caller or the others.

Components expose hooks as plain lists of callables (append at any time; a listener added while
the list is being walked is seen from the next event on). :func:`notify` walks a snapshot of such
a list, so a listener may remove itself while being called, and logs a listener's exception
(``"<what> listener failed"``, with the caller's ``extra=`` keys) instead of raising it: a hook
is an observer and must never change the outcome of what it observes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TypeVarTuple

__all__ = ["notify"]

Ts = TypeVarTuple("Ts")


def notify(
    listeners: Iterable[Callable[[*Ts], object]],
    *args: *Ts,
    logger: logging.Logger,
    what: str,
    extra: Mapping[str, object],
) -> None:
    """Call every listener with ``args``; log (on ``logger``) and swallow what one raises."""
    for listener in tuple(listeners):
        try:
            listener(*args)
        except Exception:
            logger.exception("%s listener failed", what, extra=dict(extra))
