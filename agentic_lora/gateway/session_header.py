"""Sessions named by an ``X-Session-ID`` header, under a gateway API key.

Rollout frameworks (verifiers, SkyRL) send ``X-Session-ID: <rollout id>`` on every turn, and one
``Authorization: Bearer <api key>`` for all their rollouts. Such a header alone proves nothing
(rollout ids are guessable), so a header-keyed Session needs an authenticated caller:

* the ``Bearer`` token must be one of the gateway's API keys (``api_keys``, or
  ``$AGENTIC_LORA_GATEWAY_API_KEYS``, comma-separated), else ACCESS_DENIED;
* the Session is scoped to that key: its id is ``xsid-`` plus an HMAC of the header under the
  key, so the same ``X-Session-ID`` under two keys names two Sessions, and no key reaches another
  key's Session (nor does a Session-id bearer: ids starting ``xsid-`` are refused as such);
* one key holds any number of Sessions (one per ``X-Session-ID``);
* a bearer token that is an API key is never itself a Session id: without ``X-Session-ID`` the
  request is refused, never folded into one Session shared by every rollout of the key.

The header is checked (length, charset) before anything else happens. Every refusal is a typed
error with a stable code and ``details.reason``:

| refusal | code | reason |
| --- | --- | --- |
| header too long, empty, or outside ``[A-Za-z0-9._:@+=/-]`` | INVALID_REQUEST (400) | ``bad_session_header`` |
| header sent together with ``X-Agentic-Session`` | INVALID_REQUEST (400) | ``conflicting_session_headers`` |
| header without a gateway API key as bearer | ACCESS_DENIED (401) | ``session_header_needs_api_key`` |
| API key without the header | ACCESS_DENIED (401) | ``missing_session_header`` |
| a bearer or ``X-Agentic-Session`` id starting ``xsid-`` | ACCESS_DENIED (401) | ``reserved_session_id`` |
"""

from __future__ import annotations

import hashlib
import hmac
import os
import string
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass

from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.gateway.security import SESSION_HEADER
from agentic_lora.gateway.security import session_id_from_headers

__all__ = [
    "API_KEYS_ENV",
    "MAX_SESSION_HEADER_LENGTH",
    "SESSION_ID_HEADER",
    "HeaderSession",
    "SessionHeaders",
]

#: The header rollout frameworks name their rollout's Session with.
SESSION_ID_HEADER = "x-session-id"
#: Environment variable of the gateway API keys (comma-separated), when not given in code.
API_KEYS_ENV = "AGENTIC_LORA_GATEWAY_API_KEYS"
MAX_SESSION_HEADER_LENGTH = 128
_ALLOWED = frozenset(string.ascii_letters + string.digits + "._:@+=/-")
_SCOPED_PREFIX = "xsid-"


@dataclass(frozen=True, slots=True)
class HeaderSession:
    """The Session of a request: ``session_id`` is its gateway id (for ``X-Session-ID``, the
    key-scoped one: a credential, never shown), ``shown`` the id the caller sent."""

    session_id: str
    shown: str


def _check_header(value: str) -> str:
    if not value or len(value) > MAX_SESSION_HEADER_LENGTH or not set(value) <= _ALLOWED:
        raise InvalidRequestError(
            f"X-Session-ID must be 1 to {MAX_SESSION_HEADER_LENGTH} characters of "
            "[A-Za-z0-9._:@+=/-]",
            reason="bad_session_header",
        )
    return value


def _refuse_reserved(session_id: str) -> None:
    # A header-keyed Session is reached through its key only, never by its scoped id.
    if session_id.startswith(_SCOPED_PREFIX):
        raise AccessDeniedError(
            f"Session ids starting with {_SCOPED_PREFIX!r} are reserved for X-Session-ID",
            reason="reserved_session_id",
        )


class SessionHeaders:
    """Resolves the Session of a request, header-keyed or not (see the module docstring).

    ``api_keys``: the gateway API keys (None: read ``$AGENTIC_LORA_GATEWAY_API_KEYS``; empty:
    ``X-Session-ID`` is refused). ``admin_token`` may not be one of them.
    """

    def __init__(self, api_keys: Iterable[str] | None, admin_token: str | None) -> None:
        if api_keys is None:
            api_keys = os.environ.get(API_KEYS_ENV, "").split(",")
            api_keys = [key.strip() for key in api_keys if key.strip()]
        keys = tuple(api_keys)
        for key in keys:
            if not key or key != key.strip() or any(c.isspace() for c in key):
                raise ConfigurationError(
                    "a gateway API key must be non-empty, without whitespace", check="api_keys"
                )
            if admin_token is not None and hmac.compare_digest(key.encode(), admin_token.encode()):
                raise ConfigurationError(
                    "a gateway API key must differ from the admin token", check="api_keys"
                )
        self._keys = tuple(key.encode() for key in keys)
        self._admin_token = admin_token

    def _api_key(self, headers: Mapping[str, str]) -> bytes | None:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        given = token.strip().encode()
        found = None
        for key in self._keys:  # every key compared: the time says nothing about which matched
            if hmac.compare_digest(given, key):
                found = key
        return found

    def header_session(self, headers: Mapping[str, str]) -> HeaderSession | None:
        """The header-keyed Session a request names, or None when it sends no ``X-Session-ID``
        and no API key (then the Session comes from ``X-Agentic-Session`` or the bearer)."""
        raw = headers.get(SESSION_ID_HEADER)
        header = _check_header(raw.strip()) if raw is not None else None
        key = self._api_key(headers)
        if header is None:
            if key is not None:
                raise AccessDeniedError(
                    "a gateway API key names no Session: send `X-Session-ID: <rollout id>`",
                    reason="missing_session_header",
                )
            return None
        if key is None:
            raise AccessDeniedError(
                "X-Session-ID needs `Authorization: Bearer <gateway API key>`",
                reason="session_header_needs_api_key",
            )
        if headers.get(SESSION_HEADER):
            raise InvalidRequestError(
                f"send X-Session-ID or {SESSION_HEADER}, not both",
                reason="conflicting_session_headers",
            )
        return HeaderSession(self.scoped(key, header), header)

    @staticmethod
    def scoped(key: bytes, header: str) -> str:
        """The gateway Session id of ``header`` under API ``key``."""
        digest = hmac.new(key, b"x-session-id\0" + header.encode(), hashlib.sha256).hexdigest()
        return _SCOPED_PREFIX + digest[:48]

    def session_id(self, headers: Mapping[str, str], *, missing: str = "no Session id") -> str:
        """The gateway Session id of a generation request."""
        return self.named(headers, missing=missing).session_id

    def named(self, headers: Mapping[str, str], *, missing: str = "no Session id") -> HeaderSession:
        """The Session a request names: by ``X-Session-ID`` under an API key, else by
        ``X-Agentic-Session`` or the bearer (then ``shown`` is that id)."""
        named = self.header_session(headers)
        if named is not None:
            return named
        session_id = session_id_from_headers(headers, self._admin_token, missing=missing)
        _refuse_reserved(session_id)
        return HeaderSession(session_id, session_id)

    def for_close(self, session_id: str, headers: Mapping[str, str]) -> HeaderSession | None:
        """``POST /v1/sessions/{id}/close`` by an API key: the Session ``id`` names as an
        ``X-Session-ID`` under that key (None: the request carries no API key)."""
        key = self._api_key(headers)
        if key is None:
            _, _, bearer = (headers.get("authorization") or "").partition(" ")
            for named in (headers.get(SESSION_HEADER) or "", bearer):
                _refuse_reserved(named.strip())
            return None
        header = _check_header(session_id)
        return HeaderSession(self.scoped(key, header), header)
