"""Shared-secret bearer tokens for control endpoints: reading them, checking them, guarding an app.

Every control surface (the gateway's admin routes, a DCS receiver sidecar) takes a token from a
file or the environment, never from a command line (which ``ps`` shows to every user), and
compares it in constant time. :class:`BearerTokenMiddleware` is a small ASGI middleware that
refuses, with 401, any HTTP request to a guarded app that does not carry
``Authorization: Bearer <token>``; the paths in ``open_paths`` (liveness) stay reachable.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from agentic_lora.errors import ConfigurationError

if TYPE_CHECKING:  # the core needs no ASGI stack; only the types are borrowed
    from starlette.types import ASGIApp
    from starlette.types import Receive
    from starlette.types import Scope
    from starlette.types import Send

__all__ = ["BearerTokenMiddleware", "bearer_matches", "read_token"]


def read_token(*, path: str | Path | None = None, env: str | None = None, what: str) -> str | None:
    """The token in file ``path`` (preferred) or environment variable ``env``; None if neither.

    A file that cannot be read, or an empty token, is a CONFIG_ERROR naming ``what`` (never the
    token). Surrounding whitespace (a trailing newline) is not part of the token.
    """
    if path is not None:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"{what} token file {path} cannot be read ({exc})", check=f"{what}_token"
            ) from exc
        if not token:
            raise ConfigurationError(f"{what} token file {path} is empty", check=f"{what}_token")
        return token
    if env is not None and env in os.environ:
        token = os.environ[env].strip()
        if not token:
            raise ConfigurationError(f"{what} token in ${env} is empty", check=f"{what}_token")
        return token
    return None


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (constant-time compare)."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # compare_digest on bytes: its time does not depend on where the first difference is.
    return hmac.compare_digest(given.strip().encode(), token.encode())


class BearerTokenMiddleware:
    """Refuses HTTP requests without the bearer token (see module docstring).

    ``refusal`` builds the 401 body (each surface answers in its own error shape).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        refusal: Callable[[], dict[str, object]],
        open_paths: Iterable[str] = (),
    ) -> None:
        if not token or not token.strip():
            raise ConfigurationError("a control token must not be empty", check="token")
        self._app = app
        self._token = token
        self._refusal = refusal
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self._app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        if bearer_matches(authorization, self._token):
            await self._app(scope, receive, send)
            return
        body = json.dumps(self._refusal()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
