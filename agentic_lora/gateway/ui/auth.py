"""Logins to the status page: the admin token once, then a cookie that is never the token.

The page is behind the gateway's admin token, but a browser should not hold the token itself
(nor put it in a URL, where history, proxies and access logs keep it). So a login exchanges it:

* :meth:`UILogins.login` takes the token a login form POSTed, compares it with the admin token in
  constant time and, when it matches, mints a **page session**: 32 random bytes (URL-safe), sent
  to the browser as an ``HttpOnly; SameSite=Strict`` cookie with an expiry. The server keeps only
  a SHA-256 of each value (a memory dump or a timing of the dict lookup reveals no live value)
  and its deadline. A value is valid until its deadline, its logout, or the gateway's restart.
* Failed logins are bounded: at most ``max_failures`` within ``failure_window`` seconds, for the
  whole gateway (a per-address limit would be evaded with many addresses). Past it every login is
  refused with ``reason="too_many_attempts"`` until the window has passed, the right token
  included, so guessing costs time whatever the attacker controls.
* At most ``max_sessions`` page sessions live at once; a new login past it ends the oldest.

I/O-free: the clock is an argument. Nothing here logs a token or a page session value.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from agentic_lora.errors import AccessDeniedError

__all__ = ["MAX_TOKEN_LENGTH", "LoginGrant", "UILogins"]

#: Bytes of randomness in a page session value (256 bits).
_SESSION_BYTES = 32
#: Longest token a login form may carry: longer input is refused before any comparison.
MAX_TOKEN_LENGTH = 4096


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class LoginGrant:
    """A new page session: the cookie ``value`` and its lifetime in seconds."""

    value: str
    max_age: int


class UILogins:
    """The status page's sessions (see the module docstring).

    ``admin_token`` None: the admin routes are disabled, and so is every login
    (``reason="admin_disabled"``).
    """

    def __init__(
        self,
        admin_token: str | None,
        *,
        ttl: float = 8 * 3600.0,
        max_sessions: int = 64,
        max_failures: int = 10,
        failure_window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl <= 0 or max_sessions < 1 or max_failures < 1 or failure_window <= 0:
            raise ValueError("ttl, max_sessions, max_failures and failure_window must be positive")
        self._token = (
            hashlib.sha256(admin_token.encode()).digest() if admin_token is not None else None
        )
        self._ttl = ttl
        self._max_sessions = max_sessions
        self._max_failures = max_failures
        self._window = failure_window
        self._clock = clock
        self._sessions: OrderedDict[str, float] = OrderedDict()  # digest -> deadline, oldest first
        self._failures: deque[float] = deque()

    @property
    def enabled(self) -> bool:
        """Whether anyone can log in (an admin token is configured)."""
        return self._token is not None

    def retry_after(self) -> float:
        """Seconds until a login is taken again (0: now)."""
        now = self._clock()
        self._forget_failures(now)
        if len(self._failures) < self._max_failures:
            return 0.0
        return max(0.0, self._failures[0] + self._window - now)

    def login(self, given: str) -> LoginGrant:
        """A new page session for the admin token ``given``; ACCESS_DENIED otherwise
        (``reason``: ``admin_disabled``, ``too_many_attempts`` or ``bad_admin_token``)."""
        if self._token is None:
            raise AccessDeniedError(
                "the status page is disabled: start the gateway with an admin token",
                reason="admin_disabled",
            )
        wait = self.retry_after()
        if wait > 0:
            raise AccessDeniedError(
                "too many failed logins; try again later",
                reason="too_many_attempts",
                retry_after=round(wait, 3),
            )
        # Digests of both, compared with compare_digest: the time taken depends neither on where
        # the first difference is nor on the token's length.
        if len(given) > MAX_TOKEN_LENGTH or not hmac.compare_digest(
            hashlib.sha256(given.strip().encode()).digest(), self._token
        ):
            self._failures.append(self._clock())
            raise AccessDeniedError("wrong admin token", reason="bad_admin_token")
        now = self._clock()
        self._expire(now)
        while len(self._sessions) >= self._max_sessions:
            self._sessions.popitem(last=False)
        value = secrets.token_urlsafe(_SESSION_BYTES)
        self._sessions[_digest(value)] = now + self._ttl
        return LoginGrant(value, int(self._ttl))

    def valid(self, value: str | None) -> bool:
        """Whether ``value`` (a cookie) is a live page session."""
        if not value or len(value) > 2 * _SESSION_BYTES + 8:
            return False
        key = _digest(value)
        deadline = self._sessions.get(key)
        if deadline is None:
            return False
        if deadline <= self._clock():
            del self._sessions[key]
            return False
        return True

    def logout(self, value: str | None) -> bool:
        """End the page session ``value``; whether it was live."""
        if not value:
            return False
        return self._sessions.pop(_digest(value), None) is not None

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._sessions)

    def _expire(self, now: float) -> None:
        for key in [k for k, deadline in self._sessions.items() if deadline <= now]:
            del self._sessions[key]

    def _forget_failures(self, now: float) -> None:
        while self._failures and self._failures[0] + self._window <= now:
            self._failures.popleft()
