"""Stale keep-alive connections: generations lost when the client's keep-alive matches the engine's.

SGLang serves HTTP with uvicorn and closes a connection idle for ``SGLANG_TIMEOUT_KEEP_ALIVE``
(5 s). A client that keeps idle connections just as long (httpx's default ``keepalive_expiry``,
which the product's engine clients used until ``agentic_lora.foundation.http_limits`` set 2 s) sends a burst
that starts just before 5 s of idleness onto connections the server is closing at that moment;
each such request fails with "Server disconnected" or "Can not write request body", which the
transport rightly classifies as indeterminate (the bytes may have reached the engine), so it
cannot be resent. Agents meet this after any pause of about 5 s: a tool call, a slow environment
step, a quiet phase.

The probe: a uvicorn server with ``--timeout-keep-alive 5`` (the engines' server stack), and per
trial one client that opens ``--burst`` connections with one burst, idles for a given time, then
sends a second burst. Rows: the product's :class:`~agentic_lora.engines.transport.EngineTransport` as it
is now, and a plain httpx client on the same aiohttp transport with ``keepalive_expiry`` 5 s and
2 s.

Prints the failures per idle time and writes ``bench/out/keepalive_race.json``.

Usage: python bench/keepalive_race.py [--burst 256]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any

import httpx
from common import BENCH_DIR
from common import free_port
from common import machine
from common import print_table
from common import write_result
from httpx_aiohttp import AiohttpTransport

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport

__all__ = ["app", "main", "run"]

IDLE_SECONDS = (4.6, 4.7, 4.8, 4.85, 4.9, 4.95, 5.0, 5.1)
SERVER_KEEP_ALIVE = 5

Scope = dict[str, Any]
Message = dict[str, Any]


async def app(
    scope: Scope,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """A minimal ASGI engine: reads the body, answers ``{}`` at once."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"{}"})


Post = Callable[[], Awaitable[None]]


async def _burst(post: Post, n: int) -> list[str]:
    async def one() -> str | None:
        try:
            await post()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    return [r for r in await asyncio.gather(*(one() for _ in range(n))) if r is not None]


async def trial_product(url: str, idle: float, n: int) -> list[str]:
    """The product's EngineTransport as shipped (its own keep-alive setting)."""
    transport = EngineTransport([EngineRef("e0", url)])
    try:

        async def post() -> None:
            await transport.send("e0", "/generate", {"text": "x"})

        await _burst(post, n)
        await asyncio.sleep(idle)
        return await _burst(post, n)
    finally:
        await transport.aclose()


async def trial_httpx(url: str, idle: float, n: int, expiry: float) -> list[str]:
    """A plain httpx client on the aiohttp transport with ``keepalive_expiry=expiry``."""
    limits = httpx.Limits(
        max_connections=512, max_keepalive_connections=512, keepalive_expiry=expiry
    )
    async with httpx.AsyncClient(
        transport=AiohttpTransport(retries=0, limits=limits, trust_env=False),
        timeout=30.0,
        trust_env=False,
    ) as client:

        async def post() -> None:
            (await client.post(url + "/generate", json={"text": "x"})).raise_for_status()

        await _burst(post, n)
        await asyncio.sleep(idle)
        return await _burst(post, n)


class Server:
    """``uvicorn keepalive_race:app --timeout-keep-alive 5`` in a child process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Server:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", "keepalive_race:app",
            "--app-dir", str(BENCH_DIR), "--port", str(self.port),
            "--timeout-keep-alive", str(SERVER_KEEP_ALIVE), "--log-level", "warning",
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient(trust_env=False) as probe:
            while True:
                try:
                    await probe.post(self.url + "/generate", json={})
                    return self
                except httpx.TransportError:
                    if self._process.returncode is not None or time.monotonic() > deadline:
                        raise RuntimeError("the uvicorn probe server did not start") from None
                    await asyncio.sleep(0.1)

    async def __aexit__(self, *exc: object) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            await self._process.wait()


async def run(burst: int) -> dict[str, Any]:
    """Every client row at every idle time; returns failures per (row, idle)."""
    rows: dict[str, Callable[[str, float], Awaitable[list[str]]]] = {
        "EngineTransport": lambda url, idle: trial_product(url, idle, burst),
        "httpx, keepalive_expiry=5": lambda url, idle: trial_httpx(url, idle, burst, 5.0),
        "httpx, keepalive_expiry=2": lambda url, idle: trial_httpx(url, idle, burst, 2.0),
    }
    results: dict[str, dict[str, Any]] = {}
    async with Server() as server:
        for name, trial in rows.items():
            results[name] = {}
            for idle in IDLE_SECONDS:
                failures = await trial(server.url, idle)
                results[name][str(idle)] = {"failed": len(failures), "examples": failures[:2]}
    return results


def main() -> None:
    """Parse arguments, run every trial, print the table, write the JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--burst", type=int, default=256, help="requests per burst (and connections)")
    a = p.parse_args()
    started = machine()
    results = asyncio.run(run(a.burst))
    print(
        f"failed requests of a burst of {a.burst} after the given idle time (server keep-alive 5 s)"
    )
    print_table(
        ["client", *(f"{idle} s" for idle in IDLE_SECONDS)],
        [[name, *(r[str(i)]["failed"] for i in IDLE_SECONDS)] for name, r in results.items()],
    )
    examples = {e for r in results.values() for x in r.values() for e in x["examples"]}
    for example in sorted(examples)[:3]:
        print(f"  e.g. {example}")
    payload = {
        "machine": started,
        "burst": a.burst,
        "server_keep_alive_s": SERVER_KEEP_ALIVE,
        "results": results,
    }
    print(f"written: {write_result('keepalive_race', payload)}")


if __name__ == "__main__":
    main()
