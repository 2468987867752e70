"""How one lease call (``open_lease``, ``renew_lease``, ``close_lease``) is replayed: with the same
request id, which the registry answers from its memory, only after a lost reply, until a stop."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from collections.abc import Callable

from tenacity import AsyncRetrying
from tenacity import RetryCallState
from tenacity import retry_if_exception
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from agentic_lora.foundation.replay import is_lost_reply

__all__ = ["StopWhen", "log_replay", "replaying"]

logger = logging.getLogger(__name__)


def replaying(
    stop: stop_base, *, wait: wait_base, sleep: Callable[[float], Awaitable[None]]
) -> AsyncRetrying:
    """Attempts of one lease call: a lost reply is replayed, any other error is raised as is."""
    return AsyncRetrying(
        stop=stop,
        wait=wait,
        retry=retry_if_exception(is_lost_reply),
        sleep=sleep,
        reraise=True,
    )


def log_replay(verb: str, lease_id: str, state: RetryCallState) -> None:
    """Log every attempt after the first (a replay of the same request id)."""
    if state.attempt_number > 1:
        logger.warning(
            "replaying lease call with the same request id",
            extra={"verb": verb, "lease": lease_id, "attempt": state.attempt_number},
        )


class StopWhen(stop_base):
    """A tenacity stop from a predicate (stop_base has no such factory)."""

    def __init__(self, predicate: Callable[[RetryCallState], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate(retry_state)
