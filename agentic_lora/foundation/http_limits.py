"""Connection pooling for every HTTP client that talks to engines, their sidecars or the gateway.

SGLang, vLLM, the DCS sidecar and the gateway (``agentic-lora serve``) serve HTTP with uvicorn,
which closes a keep-alive connection after 5 s idle. A client that keeps idle connections just as
long writes a burst that starts ~5 s after the last one onto connections the server is closing at
that moment: the requests fail after they may have been sent (indeterminate), and nothing below
the caller may resend them. Measured by ``bench/keepalive_race.py``: up to 168 of 256 generations
failed at equal timeouts, none with idle connections dropped at 2 s. Every such client therefore
drops idle connections well before the server does (the tests' and the demo's own clients too).
"""

from __future__ import annotations

import httpx

__all__ = ["ENGINE_KEEPALIVE_EXPIRY", "SERVER_KEEPALIVE", "engine_limits"]

#: uvicorn's default ``--timeout-keep-alive`` (SGLang, vLLM, the DCS sidecar).
SERVER_KEEPALIVE = 5.0
#: How long an idle engine connection may be kept for reuse.
ENGINE_KEEPALIVE_EXPIRY = 2.0


def engine_limits(
    max_connections: int = 100, keepalive_expiry: float = ENGINE_KEEPALIVE_EXPIRY
) -> httpx.Limits:
    """Pool limits for an engine client; refuses a keep-alive the server may outlast."""
    if not 0 < keepalive_expiry < SERVER_KEEPALIVE:
        from agentic_lora.errors import ConfigurationError

        raise ConfigurationError(
            f"keepalive_expiry must be in (0, {SERVER_KEEPALIVE}) s, below the engines' keep-alive",
            check="keepalive",
        )
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=keepalive_expiry,
    )
