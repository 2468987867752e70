"""Registry calls of the gateway's Sessions, replayed with one request id when their reply is lost.

A registry verb is idempotent per request id, so a call whose reply was lost (a dead actor, a
dropped connection) may be sent again with the same id: the registry answers it once. A typed
error is the registry's answer and is never replayed. When no attempt is confirmed, the caller's
request is refused with ``REQUEST_REFUSED``: no generation was sent.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn
from typing import TypeVar

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.foundation.replay import RegistryRetry

__all__ = ["SessionReplay", "replayed"]

_T = TypeVar("_T")


async def replayed(
    verb: str,
    tag: str,
    call: Callable[[], Awaitable[_T]],
    retry: RegistryRetry,
) -> _T:
    """``call()``, replayed by ``retry`` (same request id) while its reply may have been lost; a
    call never confirmed is refused with ``REQUEST_REFUSED`` (a typed error is raised as it is).

    ``tag`` names the Session in logs and errors (a keyed hash, never the Session id).
    """
    try:
        return await retry.call(verb, call, log_extra={"session": tag})
    except Exception as exc:
        _refused(verb, tag, exc)


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
