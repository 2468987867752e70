"""Which Session an HTTP request belongs to, and when the gateway ends one on its own.

An unmodified OpenAI-SDK agent cannot call a Session API; it can only set its API key. So the
gateway reads the Session id from ``Authorization: Bearer <session id>`` (``api_key=<session
id>``), or from ``X-Agentic-Session`` when the key is needed for something else (the explicit
header wins). The first generation of an id opens its Session, which binds at that generation.

Two rules keep an agent on one policy even when the gateway ends its Session:

* A closed id is remembered (bounded memory) and a later request with it is refused with
  ``SESSION_CLOSED``: a straggling request after close would otherwise open a fresh Session,
  silently bound to whatever version is the default by then.
* Idle expiry (optional) closes a Session only when nothing of it is in flight, and the same
  closed-id memory applies to it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from agentic_lora.errors import (
    AccessDeniedError,
    InvalidRequestError,
    SessionClosedError,
    SessionReleaseError,
)
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.session import Session, SessionPhase, Versioning

__all__ = [
    "MAX_SESSION_ID_LENGTH",
    "SESSION_HEADER",
    "GatewaySessions",
    "session_id_from_headers",
]

logger = logging.getLogger(__name__)

#: The explicit Session header (wins over ``Authorization``).
SESSION_HEADER = "x-agentic-session"
MAX_SESSION_ID_LENGTH = 256


def _checked(session_id: str, source: str) -> str:
    if len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidRequestError(
            f"the Session id in {source} is longer than {MAX_SESSION_ID_LENGTH} characters",
            reason="bad_session_id",
        )
    if not session_id.isprintable() or any(c.isspace() for c in session_id):
        raise InvalidRequestError(
            f"the Session id in {source} must be printable and without whitespace",
            reason="bad_session_id",
        )
    return session_id


def session_id_from_headers(headers: Mapping[str, str]) -> str:
    """The Session id of a request: ``X-Agentic-Session``, else the ``Bearer`` token.

    ``headers`` must look names up case-insensitively (Starlette's and httpx's headers do).
    Raises ACCESS_DENIED when neither is present.
    """
    explicit = headers.get(SESSION_HEADER)
    if explicit is not None and explicit.strip():
        return _checked(explicit.strip(), SESSION_HEADER)
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return _checked(token.strip(), "Authorization")
    raise AccessDeniedError(
        "no Session id: send `Authorization: Bearer <session id>` (the OpenAI api_key) or "
        f"`{SESSION_HEADER}: <session id>`",
        reason="missing_session",
    )


class GatewaySessions:
    """The gateway's Sessions: open on first use, close on request or when idle.

    ``clock`` only measures idleness. ``closed_id_memory`` bounds how many closed ids are
    remembered (oldest forgotten first); ``reuse_closed_ids=True`` turns the memory off, so a
    closed id opens a new Session (a new binding) on its next request.
    """

    def __init__(
        self,
        versioning: Versioning,
        *,
        clock: Callable[[], float] = time.monotonic,
        closed_id_memory: int = 65536,
        reuse_closed_ids: bool = False,
    ) -> None:
        self._versioning = versioning
        self._clock = clock
        self._memory = closed_id_memory
        self._reuse = reuse_closed_ids
        self._last_used: dict[str, float] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()  # id -> why it was closed

    def open(self, session_id: str) -> Session:
        """The live Session for ``session_id``, opened (unbound) if there is none."""
        why = self._closed.get(session_id)
        if why is not None:
            raise SessionClosedError(
                f"session {session_id!r} was closed ({why}); start a new Session with a new id",
                session=session_id,
                reason=why,
            )
        # No await between the lookup and the open: two concurrent first requests of one id
        # share one Session (and so one bind task).
        session = self._versioning.get(session_id) or self._versioning.open_session(session_id)
        self._last_used[session_id] = self._clock()
        return session

    def touch(self, session_id: str) -> None:
        """Mark ``session_id`` as used now (called when a request of it ends)."""
        if session_id in self._last_used:
            self._last_used[session_id] = self._clock()

    def live(self) -> int:
        """Sessions opened here and not yet closed."""
        return len(self._last_used)

    def _remember_closed(self, session_id: str, why: str) -> None:
        if self._reuse:
            return
        self._closed[session_id] = why
        self._closed.move_to_end(session_id)
        while len(self._closed) > self._memory:
            self._closed.popitem(last=False)

    async def close(self, session_id: str, *, why: str = "closed") -> ReleaseResult | None:
        """Close the live Session ``session_id``; None when there is none.

        The id is refused from the moment the close starts, so no request can slip in and open
        a second lifecycle while the first one drains.
        """
        session = self._versioning.get(session_id)
        if session is None:
            return None
        self._remember_closed(session_id, why)
        result = await session.close()
        self._last_used.pop(session_id, None)
        return result

    async def reap_idle(self, idle_for: float) -> tuple[str, ...]:
        """Close every Session unused for ``idle_for`` seconds with nothing in flight.

        Sessions whose earlier release was not confirmed (still FINALIZING) are closed again.
        Returns the ids closed by this call; a release that fails again is logged and retried by
        the next call.
        """
        now = self._clock()
        closed: list[str] = []
        for session_id, last in list(self._last_used.items()):
            session = self._versioning.get(session_id)
            if session is None:  # closed by someone else (e.g. the Python API)
                self._last_used.pop(session_id, None)
                continue
            stuck = session.phase is SessionPhase.FINALIZING
            if not stuck and (session.in_flight or now - last < idle_for):
                continue
            try:
                await self.close(session_id, why="idle")
            except SessionReleaseError as exc:
                logger.warning(
                    "idle Session close not confirmed; retried next round",
                    extra={"session": session.key, "error": exc.code},
                )
                continue
            closed.append(session_id)
            logger.info("idle Session closed", extra={"session": session.key})
        return tuple(closed)
