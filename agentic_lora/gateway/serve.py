"""Run the Session gateway as a server: ``agentic-lora serve`` and embedders use this.

Start-up order: the port is free, the settings are valid, the engines answer and have enough
LoRA slots (:func:`~agentic_lora.config.verify_fleet`); only then is anything served. On the way
out every live Session is closed (released exactly once) and the journal flushed.

Importing this module imports none of the ASGI stack (the CLI reads its defaults); :func:`serve`
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING
from typing import Any

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import verify_fleet
from agentic_lora.errors import ConfigurationError

if TYPE_CHECKING:
    from agentic_lora.gateway.app import Gateway

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ServeOptions", "Served", "serve"]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServeOptions:
    """Everything :func:`serve` runs with (``agentic-lora serve`` resolves them from its config
    file, environment and flags)."""

    settings: AgenticLoRASettings
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    admin_token: str | None = None
    idle_timeout: float | None = None
    reuse_closed_ids: bool = False
    access_log: bool = False
    verify_engines: bool = True


@dataclass(frozen=True)
class Served:
    """A running :func:`serve`: its base URL and the gateway behind it (for embedders)."""

    url: str
    gateway: Gateway


def _listen(host: str, port: int) -> socket.socket:
    # Bound here, before the deployment starts, so a busy port is one clear error and no engine
    # or journal was touched.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", check="port"
        ) from exc
    sock.setblocking(False)
    return sock


async def serve(
    options: ServeOptions,
    *,
    on_ready: Callable[[Served], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the gateway until ``stop`` is set or SIGINT/SIGTERM arrives, then close cleanly.

    ``on_ready`` receives the :class:`Served` handle once the socket accepts connections.
    """
    import uvicorn

    from agentic_lora.gateway.app import Gateway

    class _Server(uvicorn.Server):
        # Signals are ours (below): uvicorn's own handling would re-raise SIGTERM after its
        # shutdown and kill the process before the Sessions are released.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                ready.set()

    ready = asyncio.Event()
    sock = _listen(options.host, options.port)
    try:
        gateway = await Gateway.from_settings(
            options.settings,
            backend_options=options.backend_options,
            admin_token=options.admin_token,
            idle_timeout=options.idle_timeout,
            reuse_closed_ids=options.reuse_closed_ids,
        )
    except BaseException:
        sock.close()
        raise
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    started = False
    try:
        if options.verify_engines:
            await verify_fleet(options.settings, gateway.versioning.transport)
        await gateway.start()
        server = _Server(
            uvicorn.Config(
                gateway.app,
                log_config=None,
                access_log=options.access_log,
                lifespan="off",
                timeout_graceful_shutdown=30,
            )
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Intentional, not unfinished: a loop without signal handlers (Windows' proactor
            # loop) raises NotImplementedError, a loop off the main thread RuntimeError or
            # ValueError. serve then runs without them; the caller stops it with its `stop` event.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        waiters = [asyncio.ensure_future(ready.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait({serving, *waiters}, return_when="FIRST_COMPLETED")
            if ready.is_set() and not stop.is_set():
                started = True
                if options.admin_token is None:
                    logger.warning("no admin token: the /admin routes are disabled")
                if on_ready is not None:
                    on_ready(Served(url, gateway))
                await asyncio.wait({serving, waiters[1]}, return_when="FIRST_COMPLETED")
        finally:
            server.should_exit = True
            for waiter in waiters:
                waiter.cancel()
            await asyncio.wait({serving})
        serving.result()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        sock.close()
        await gateway.aclose()
        if started:
            logger.info("agentic-lora gateway stopped")
