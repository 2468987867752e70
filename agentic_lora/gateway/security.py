"""Who a gateway request is, and how the gateway speaks of a Session without revealing it.

A gateway Session id is a bearer credential: whoever knows it can generate in the Session and
close it. So it never appears in a log line, a metric, an engine request or the access log:

* :class:`SessionTagger` turns an id into a short keyed hash (HMAC-SHA256 under a secret key,
  24 hex characters). The tag is the prefix of every registry key the gateway mints, so the
  Session's own logs (:mod:`agentic_lora.session`) and the gateway's carry the same tag, and
  never the id. Without the key the tag cannot be reversed or tested against guessed ids.
* :func:`caller_of` reads the credentials of a request: the Session it names
  (``X-Agentic-Session`` or ``Authorization: Bearer <id>``) and whether it carries the admin
  token. Two headers that name different Sessions are refused (400), never silently resolved.
  :func:`session_id_from_headers` is the same for a route that needs a Session (403 without).
* :class:`AccessLogRedactor` keeps the Session id in the legacy close path
  (``/v1/sessions/<id>/close``) out of uvicorn's access log, whatever the id holds (uvicorn logs
  the decoded path, so an id with ``/`` in it spans several segments).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import InvalidRequestError

__all__ = [
    "MAX_SESSION_ID_LENGTH",
    "SESSION_HEADER",
    "AccessLogRedactor",
    "Caller",
    "SessionTagger",
    "caller_of",
    "check_session_id",
    "install_access_log_redactor",
    "redacted_path",
    "session_id_from_headers",
]

#: The explicit Session header.
SESSION_HEADER = "x-agentic-session"
MAX_SESSION_ID_LENGTH = 256
_TAG_HEX = 24  # 96 bits: no two live Sessions share a tag in practice


class SessionTagger:
    """Keyed hashes of Session ids (see module docstring).

    ``key``: the secret (bytes). None draws a random one, so tags only correlate within one
    process; give a stable key (``Gateway.from_settings`` derives it from the admin token, or
    ``AGENTIC_LORA_SESSION_HASH_KEY``) to correlate logs across restarts and replicas.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key else secrets.token_bytes(32)

    @classmethod
    def derived(cls, secret: str, purpose: bytes = b"agentic-lora session tag") -> SessionTagger:
        """A tagger whose key is derived from another secret (the secret itself is not the key,
        so a tag reveals nothing about it either)."""
        return cls(hmac.new(secret.encode(), purpose, hashlib.sha256).digest())

    def tag(self, session_id: str) -> str:
        """``s-<24 hex>``: the same id always gives the same tag under one key."""
        digest = hmac.new(self._key, session_id.encode(), hashlib.sha256).hexdigest()
        return "s-" + digest[:_TAG_HEX]


def check_session_id(session_id: str, source: str) -> str:
    """``session_id`` if it can be a Session id (at most 256 printable characters, no
    whitespace), else INVALID_REQUEST (``reason="bad_session_id"``) naming ``source``, never the
    value."""
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


@dataclass(frozen=True, slots=True)
class Caller:
    """The credentials of one request.

    ``session_id``: the Session the request names (None: none). ``admin``: its ``Authorization``
    carried the admin token (then that header names no Session).
    """

    session_id: str | None
    admin: bool


def caller_of(headers: Mapping[str, str], admin_token: str | None = None) -> Caller:
    """Read the Session id and the admin credential of a request.

    ``headers`` must look names up case-insensitively (Starlette's and httpx's do). The Session
    is ``X-Agentic-Session`` or the ``Bearer`` token; when both are given they must be equal
    (else INVALID_REQUEST, ``reason="conflicting_session_headers"``), except that a bearer token
    equal to ``admin_token`` is the admin credential, not a Session id.
    """
    explicit = (headers.get(SESSION_HEADER) or "").strip() or None
    if explicit is not None:
        explicit = check_session_id(explicit, SESSION_HEADER)
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" and token.strip() else None
    # compare_digest on bytes: its time does not depend on where the first difference is.
    admin = (
        admin_token is not None
        and bearer is not None
        and hmac.compare_digest(bearer.encode(), admin_token.encode())
    )
    named = None if admin or bearer is None else check_session_id(bearer, "Authorization")
    if explicit is not None and named is not None and explicit != named:
        # Either choice would act on a Session the caller may not have meant: a proxy that
        # injects one header must not redirect another client's turns or closes.
        raise InvalidRequestError(
            f"Authorization and {SESSION_HEADER} name different Sessions; send one, or the same "
            "id in both",
            reason="conflicting_session_headers",
        )
    return Caller(explicit if explicit is not None else named, admin)


def session_id_from_headers(
    headers: Mapping[str, str], admin_token: str | None = None, *, missing: str = "no Session id"
) -> str:
    """The Session id of a request: ``X-Agentic-Session`` or the ``Bearer`` token.

    See :func:`caller_of` (two headers naming different Sessions
    are INVALID_REQUEST). Raises ACCESS_DENIED (its message starting with ``missing``) when the
    request names no Session.
    """
    session_id = caller_of(headers, admin_token).session_id
    if session_id is None:
        raise AccessDeniedError(
            f"{missing}: send `Authorization: Bearer <session id>` (the OpenAI api_key) or "
            f"`{SESSION_HEADER}: <session id>`",
            reason="missing_session",
        )
    return session_id


_SESSIONS_PREFIX = "/v1/sessions/"
_OWN_CLOSE = "/v1/sessions/close"


def redacted_path(path: str) -> str:
    """``path`` with any Session id in it replaced by ``-``: everything under ``/v1/sessions/``
    but the own-close route becomes ``/v1/sessions/-/close`` (or ``/v1/sessions/-``), query
    string dropped. Other paths are returned unchanged."""
    bare = path.partition("?")[0]
    if not bare.startswith(_SESSIONS_PREFIX) or bare == _OWN_CLOSE:
        return path
    # Not a pattern over segments: the logged path is decoded, so "a%2Fb" arrives as "a/b".
    return _SESSIONS_PREFIX + ("-/close" if bare.endswith("/close") else "-")


class AccessLogRedactor(logging.Filter):
    """Rewrites ``/v1/sessions/<id>/close`` to ``/v1/sessions/-/close`` in uvicorn access logs
    (see :func:`redacted_path`).

    uvicorn's access record carries ``(client, method, path, http version, status)`` as args;
    only the path is rewritten, and a record of any other shape passes untouched.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            path = redacted_path(args[2])
            if path != args[2]:
                record.args = (*args[:2], path, *args[3:])
        return True


_REDACTOR = AccessLogRedactor()


def install_access_log_redactor() -> None:
    """Attach the redactor to ``uvicorn.access`` (idempotent: one filter object)."""
    logging.getLogger("uvicorn.access").addFilter(_REDACTOR)
