"""The exit status of a command that runs real engines: one contract for the demo and the examples.

0 and 1 are the command's own (every check passed / a check failed); :func:`failures_exit` maps
what escapes the engines' ``with`` block: an interrupt (Ctrl-C, or SIGTERM turned into one) to
130 and any other exception to 2, after its traceback. It belongs *outside* the fleet's ``with``,
so that the engines have stopped by the time it says so.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

__all__ = ["FAILED", "INTERRUPTED", "failures_exit"]

INTERRUPTED = 130
"""The exit status after an interrupt (128 + SIGINT, as a shell reports it)."""

FAILED = 2
"""The exit status after an error (1 is left for "a check failed")."""


@contextlib.contextmanager
def failures_exit(what: str) -> Iterator[None]:
    """Turn an interrupt or an error inside into :class:`SystemExit` with the status above."""
    try:
        yield
    except KeyboardInterrupt:
        print("\ninterrupted; the engines were stopped", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    except Exception:
        traceback.print_exc()
        print(f"\nthe {what} failed; the engines were stopped", file=sys.stderr)
        raise SystemExit(FAILED) from None
