"""Backoff between background retries of work an engine could not confirm.

One strategy type (tenacity's ``wait_base``) for every background retry loop, so an operator
tunes them alike and a test injects one to step them: the :class:`~agentic_lora.resolver.Resolver`
(cleanup of a blocked publication) and the :class:`~agentic_lora.reclaimer.Reclaimer` (an unload a
dead engine could not confirm). Generation requests never come here: they are sent exactly once.
"""

from __future__ import annotations

from tenacity import AsyncRetrying, RetryCallState, wait_exponential
from tenacity.wait import wait_base

__all__ = ["DEFAULT_BACKOFF_INITIAL", "DEFAULT_BACKOFF_MAX", "backoff", "delay_after"]

#: Seconds before the first retry.
DEFAULT_BACKOFF_INITIAL = 1.0
#: Longest wait between two retries.
DEFAULT_BACKOFF_MAX = 30.0

_RETRYING = AsyncRetrying()


def backoff(
    initial: float = DEFAULT_BACKOFF_INITIAL, cap: float = DEFAULT_BACKOFF_MAX
) -> wait_base:
    """``initial``, twice that, four times ... at most ``cap`` seconds between two rounds."""
    return wait_exponential(multiplier=initial, max=cap)


def delay_after(wait: wait_base, failures: int) -> float:
    """The seconds ``wait`` asks for after ``failures`` failed rounds in a row (``failures`` >= 1)."""
    state = RetryCallState(_RETRYING, None, (), {})
    state.attempt_number = failures
    return float(wait(state))
