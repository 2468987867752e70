"""Replaying a registry call whose reply may have been lost.

Every mutating registry verb carries a caller-minted ``request_id``; the registry answers a
replay with the original answer (including the original typed error). So a caller that did not
get an answer may send the same call again, and that is the only retry the project does.

:func:`is_lost_reply` is the one rule for "may a replay help?": a typed error
(:class:`~agentic_lora.errors.AgenticLoRAError`) *is* the registry's answer and is final; any
other exception (a dead Ray actor, a timeout, a dropped connection) may have hidden an answer.
:class:`RegistryRetry` is the one replay policy (how many tries, how far apart) every registry caller
takes as one value (``registry_retry=``): the publisher, reclaimer, repairer, Sessions, the lease
keeper and the gateway's Session table. It is also the replay loop most of them run, and
:func:`after_failure` is how every retried call here runs: one plain call, and the retry policy
only once that call failed (the policy's machinery costs more CPU than a fast call itself).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import TypeVar

from tenacity import AsyncRetrying
from tenacity import RetryCallState
from tenacity import retry_if_exception
from tenacity import stop_after_attempt
from tenacity import wait_exponential
from tenacity.wait import wait_base

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError

__all__ = ["RegistryRetry", "after_failure", "is_lost_reply"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def is_lost_reply(exc: BaseException) -> bool:
    """Whether replaying the call (same request id) may help: true for any non-typed Exception.

    A ``BaseException`` that is not an ``Exception`` (cancellation, interpreter exit) is never
    replayed: the caller is going away, and a replay would outlive it.
    """
    return isinstance(exc, Exception) and not isinstance(exc, AgenticLoRAError)


async def after_failure(fn: Callable[[], Awaitable[T]], policy: Callable[[], AsyncRetrying]) -> T:
    """``fn()`` once; only if it raises does ``policy`` take over, with that failure as its first
    attempt, so the policy's stop, wait, retry predicate and hooks see exactly what a loop
    entered from the start would have seen (attempt numbers included).

    A ``BaseException`` that is not an ``Exception`` (cancellation) is never handed to the policy.
    """
    try:
        return await fn()
    except Exception as exc:
        failed: Exception | None = exc
    async for attempt in policy():
        with attempt:
            if failed is not None:
                first, failed = failed, None
                raise first
            return await fn()
    raise AssertionError("unreachable: the policy either returns or raises")  # pragma: no cover


@dataclass(frozen=True)
class RegistryRetry:
    """Replays a registry call (same request id) when its reply may have been lost.

    ``attempts`` counts every try, the first one included (1: never replayed); ``wait`` is the
    tenacity wait between tries. Anything else than an integer of at least 1 is refused at
    construction with :class:`~agentic_lora.errors.ConfigurationError` (``check="registry_retry"``),
    so a component given a policy never sees a bad one.
    """

    attempts: int = 5
    wait: wait_base = field(default_factory=lambda: wait_exponential(multiplier=0.05, max=2.0))

    def __post_init__(self) -> None:
        attempts: object = self.attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(
                f"registry retry attempts must be an integer of at least 1, not {attempts!r}",
                check="registry_retry",
            )

    async def call(
        self,
        verb: str,
        fn: Callable[[], Awaitable[T]],
        *,
        log_extra: Mapping[str, object] | None = None,
    ) -> T:
        """Run ``fn`` until it answers (or raises a typed error); re-raise the last lost reply.

        ``fn`` must reuse one request id on every call: that is what makes a replay safe.
        ``log_extra`` goes into each replay's log record beside ``attempt`` and ``verb`` (e.g. the
        Session's tag).
        """

        def _log(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            logger.warning(
                "registry %s reply lost (%r); replaying with the same request id",
                verb,
                exc,
                extra={**(log_extra or {}), "attempt": state.attempt_number, "verb": verb},
            )

        def policy() -> AsyncRetrying:
            return AsyncRetrying(
                stop=stop_after_attempt(self.attempts),
                wait=self.wait,
                retry=retry_if_exception(is_lost_reply),
                before_sleep=_log,
                reraise=True,
            )

        return await after_failure(fn, policy)
