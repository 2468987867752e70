"""Registry calls of the gateway's Sessions, replayed with one request id when their reply is lost.

A registry verb is idempotent per request id, so a call whose reply was lost (a dead actor, a
dropped connection) may be sent again with the same id: the registry answers it once. A typed
error is the registry's answer and is never replayed. When no attempt is confirmed, the caller's
request is refused with ``REQUEST_REFUSED``: no generation was sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn
from typing import TypeVar

from tenacity import AsyncRetrying
from tenacity import retry_if_exception
from tenacity import stop_after_attempt

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.foundation.replay import is_lost_reply

__all__ = ["SessionReplay", "replayed"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


async def replayed(
    verb: str,
    tag: str,
    call: Callable[[], Awaitable[_T]],
    retry: RegistryRetry,
) -> _T:
    """``call()``, replayed up to ``retry.attempts`` times in all (``retry.wait`` apart) on a
    transient failure.

    ``tag`` names the Session in logs and errors (a keyed hash, never the Session id).
    """
    try:
        return await call()  # the common case, without the retry machinery's cost
    except Exception as exc:
        if not is_lost_reply(exc) or retry.attempts == 1:
            _refused(verb, tag, exc)
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(retry.attempts - 1),
            wait=retry.wait,
            retry=retry_if_exception(is_lost_reply),
            reraise=True,
        ):
            with attempt:
                logger.warning(
                    "replaying registry call with the same request id",
                    extra={
                        "session": tag,
                        "verb": verb,
                        "attempt": attempt.retry_state.attempt_number + 1,
                    },
                )
                return await call()
    except Exception as exc:
        _refused(verb, tag, exc)
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


@dataclass(frozen=True, slots=True)
class SessionReplay:
    """How one gateway replays its Sessions' registry calls: the same ``tag`` names a Session in
    logs and errors, and every call is replayed by ``retry`` (see :func:`replayed`).
    """

    tag: Callable[[str], str]
    retry: RegistryRetry

    async def __call__(self, verb: str, name: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """``call()`` replayed as :func:`replayed` does, the Session named by ``tag(name)``."""
        return await replayed(verb, self.tag(name), call, self.retry)


def _refused(verb: str, tag: str, exc: Exception) -> NoReturn:
    if isinstance(exc, AgenticLoRAError):
        raise exc
    raise RequestRefusedError(
        f"session {tag}: {verb} was not confirmed by the registry ({exc!r}); nothing was sent",
        session=tag,
        stage=verb,
    ) from exc
