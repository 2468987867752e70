"""The receiver sidecar process: an HTTP control server plus rank 1 of every attempt's group.

Run one beside each engine::

    python -m agentic_lora_dcs.sidecar --engine-url http://127.0.0.1:30000 \\
        --store-dir /var/lib/agentic-lora/adapters --host 127.0.0.1 --port 31000 \\
        --token-file /etc/agentic-lora/sidecar.token

Every control route but ``/health`` needs ``Authorization: Bearer <token>``: the token comes from
``--token-file`` or ``$AGENTIC_LORA_SIDECAR_TOKEN`` (never the command line), is compared in
constant time, and the sidecar does not start without one (``/reclaim`` unloads adapters).

It writes verified adapters under ``--store-dir`` (immutable directories the engine loads from,
so that directory must be readable by the engine) and talks to the engine's HTTP control
endpoints. The control API is in :mod:`agentic_lora_dcs.protocol`; every refusal is a
:class:`~agentic_lora_dcs.protocol.RefusalReply` with HTTP 409 when clean and 503 when not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import TypeVar

import uvicorn
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import SecretStr
from pydantic import ValidationError
from pydantic import field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.routing import Route
from starlette.types import ASGIApp

from agentic_lora.adapters.store import AdapterStore
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.auth import BearerTokenMiddleware
from agentic_lora.foundation.auth import read_token
from agentic_lora_dcs.attempts import Refused
from agentic_lora_dcs.collective import RendezvousServer
from agentic_lora_dcs.protocol import PATHS
from agentic_lora_dcs.protocol import SIDECAR_TOKEN_ENV
from agentic_lora_dcs.protocol import BeginRequest
from agentic_lora_dcs.protocol import BucketRequest
from agentic_lora_dcs.protocol import CleanupRequest
from agentic_lora_dcs.protocol import EndRequest
from agentic_lora_dcs.protocol import Reason
from agentic_lora_dcs.protocol import ReclaimRequest
from agentic_lora_dcs.protocol import RefusalReply
from agentic_lora_dcs.receiver import Receiver

__all__ = [
    "TOKEN_ENV",
    "SidecarConfig",
    "build_receiver",
    "create_app",
    "main",
    "parse_args",
    "serve",
]

#: The environment variable a sidecar (and the DCS backend) read the control token from.
TOKEN_ENV = SIDECAR_TOKEN_ENV

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)


class SidecarConfig(BaseModel):
    """Everything a sidecar needs to start.

    ``host`` is the address the publisher reaches for control, rendezvous and data alike, so it
    must be a concrete interface address, never a wildcard.
    """

    model_config = ConfigDict(extra="forbid")

    engine_url: str
    store_dir: Path
    token: SecretStr
    host: str = "127.0.0.1"

    @field_validator("host")
    @classmethod
    def _concrete_host(cls, host: str) -> str:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"--host {host!r} is a wildcard; give the address the publisher connects to"
            )
        return host

    port: int = 0
    rendezvous_port: int = 0
    collective_timeout_s: float = 300.0
    probe: bool = True
    ready_file: Path | None = None
    engine_name: str | None = None
    log_level: str = "INFO"


def _refusal(refused: Refused) -> JSONResponse:
    body = RefusalReply(
        reason=refused.reason,
        message=refused.message,
        clean=refused.clean,
        details={k: _jsonable(v) for k, v in refused.details.items()},
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=409 if refused.clean else 503)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value


def _message_route(
    name: str,
    model: type[_M],
    handler: Callable[[_M], Awaitable[BaseModel]],
    *,
    clean_if_malformed: bool,
) -> Route:
    """``POST PATHS[name]``: ``model`` in, ``handler``'s reply out, every failure a refusal."""

    async def endpoint(request: Request) -> Response:
        raw = await request.body()
        try:
            message = model.model_validate_json(raw)
        except ValidationError as exc:
            # A message that does not parse changed nothing; for a Begin that also means the
            # attempt holds nothing, for a later message its earlier state is untouched.
            return _refusal(
                Refused(
                    Reason.BAD_REQUEST,
                    f"malformed {model.__name__}: {exc.error_count()} error(s): {exc.errors()[:3]}",
                    clean=clean_if_malformed,
                )
            )
        try:
            reply = await handler(message)
        except Refused as refused:
            return _refusal(refused)
        except Exception:
            logger.exception("sidecar %s failed", request.url.path)
            return _refusal(
                Refused(Reason.INTERNAL, "internal error; see sidecar log", clean=False)
            )
        return JSONResponse(reply.model_dump(mode="json"))

    return Route(PATHS[name], endpoint, methods=["POST"])


def create_app(
    receiver: Receiver, *, token: str, extra_routes: Sequence[BaseRoute] = ()
) -> ASGIApp:
    """The control server for ``receiver`` (``extra_routes`` lets a host add its own).

    Every route but ``/health`` is behind the bearer ``token``; a request without it is refused
    with 401 and an ``UNAUTHORIZED`` refusal (clean: nothing was done).
    """

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "sidecar_id": receiver.sidecar_id})

    async def incarnation(_: Request) -> Response:
        try:
            reply = await receiver.incarnation()
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            # A read that failed changed nothing: a clean answer, whatever the engine's state.
            return _refusal(Refused(Reason.ENGINE_UNAVAILABLE, exc.message, clean=True))
        return JSONResponse(reply.model_dump(mode="json"))

    async def status(_: Request) -> Response:
        return JSONResponse(receiver.status().model_dump(mode="json"))

    routes: list[BaseRoute] = [
        Route(PATHS["health"], health, methods=["GET"]),
        Route(PATHS["incarnation"], incarnation, methods=["GET"]),
        Route(PATHS["status"], status, methods=["GET"]),
        _message_route("begin", BeginRequest, receiver.begin, clean_if_malformed=True),
        _message_route("bucket", BucketRequest, receiver.bucket, clean_if_malformed=False),
        _message_route("end", EndRequest, receiver.end, clean_if_malformed=False),
        _message_route("cleanup", CleanupRequest, receiver.cleanup, clean_if_malformed=False),
        _message_route("reclaim", ReclaimRequest, receiver.reclaim, clean_if_malformed=False),
        *extra_routes,
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await receiver.aclose()

    return BearerTokenMiddleware(
        Starlette(routes=routes, lifespan=lifespan),
        token=token,
        open_paths=(PATHS["health"],),
        refusal=lambda: RefusalReply(
            reason=Reason.UNAUTHORIZED,
            message="missing or wrong control token (Authorization: Bearer <token>)",
            clean=True,
        ).model_dump(mode="json"),
    )


def build_receiver(
    config: SidecarConfig, *, engine_client: EngineAdminClient | None = None
) -> tuple[Receiver, EngineAdminClient]:
    """A receiver wired to the real engine client, adapter store and rendezvous store."""
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    engine = engine_client or EngineAdminClient(
        config.engine_url, engine=config.engine_name, timeouts=AdminTimeouts()
    )
    store = AdapterStore(config.store_dir)
    store.discard_partials()
    rendezvous = RendezvousServer(config.host, config.rendezvous_port, timeout=timeout)
    receiver = Receiver(
        engine=engine,
        store=store,
        rendezvous=rendezvous,
        collective_timeout=timeout,
        probe=config.probe,
    )
    return receiver, engine


async def serve(config: SidecarConfig, app: ASGIApp, *, on_ready: Callable[[int], None]) -> None:
    """Serve ``app`` on ``config.host:config.port`` (0: any free port, reported to on_ready)."""
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP, and without it every keep-alive reply waits ~40 ms (Nagle
    # against the client's delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    # Listening before uvicorn starts: early connections wait in the backlog, none is refused.
    sock.listen(128)
    on_ready(int(sock.getsockname()[1]))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    await server.serve(sockets=[sock])


def write_ready_file(path: Path, payload: dict[str, Any]) -> None:
    """Atomically publish how to reach this sidecar (for launchers and tests)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def parse_args(argv: Sequence[str] | None = None) -> SidecarConfig:
    """The sidecar's settings from its command line (CONFIG_ERROR when they cannot work)."""
    parser = argparse.ArgumentParser(
        prog="python -m agentic_lora_dcs.sidecar",
        description="DCS receiver sidecar: staged LoRA publication into one engine.",
    )
    parser.add_argument("--engine-url", required=True, help="the engine's HTTP base URL")
    parser.add_argument("--engine-name", default=None, help="name used in logs")
    parser.add_argument("--store-dir", required=True, type=Path, help="adapter directory root")
    parser.add_argument("--host", default="127.0.0.1", help="control and data-plane interface")
    parser.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    parser.add_argument("--rendezvous-port", type=int, default=0, help="TCPStore port (0: any)")
    parser.add_argument(
        "--collective-timeout",
        dest="collective_timeout_s",
        type=float,
        default=300.0,
        help="seconds",
    )
    parser.add_argument(
        "--no-probe", dest="probe", action="store_false", help="skip the one-token probe"
    )
    parser.add_argument("--ready-file", type=Path, default=None, help="write the port here")
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"file holding the control token (else ${TOKEN_ENV}; required)",
    )
    parser.add_argument("--log-level", default="INFO")
    ns = parser.parse_args(argv)
    try:
        return _config(ns)
    except ValidationError as exc:
        raise ConfigurationError(f"invalid sidecar settings: {exc}") from exc


def _config(ns: argparse.Namespace) -> SidecarConfig:
    # Every other option's dest is a SidecarConfig field, and the model forbids extras, so an
    # option added without its field (or misnamed) fails here rather than being dropped.
    settings = vars(ns)
    token = read_token(path=settings.pop("token_file"), env=TOKEN_ENV, what="sidecar")
    if token is None:
        raise ConfigurationError(
            f"the sidecar needs a control token: --token-file PATH or ${TOKEN_ENV}",
            check="sidecar_token",
        )
    return SidecarConfig.model_validate({**settings, "token": token})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m agentic_lora_dcs.sidecar``."""
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    receiver, engine = build_receiver(config)
    app = create_app(receiver, token=config.token.get_secret_value())

    def ready(port: int) -> None:
        logger.info(
            "sidecar %s serving on %s:%d (rendezvous %d), engine %s",
            receiver.sidecar_id,
            config.host,
            port,
            receiver.rendezvous_port,
            config.engine_url,
        )
        if config.ready_file is not None:
            write_ready_file(
                config.ready_file,
                {
                    "url": f"http://{config.host}:{port}",
                    "rendezvous_port": receiver.rendezvous_port,
                    "sidecar_id": receiver.sidecar_id,
                    "pid": os.getpid(),
                },
            )

    async def run() -> None:
        try:
            await serve(config, app, on_ready=ready)
        finally:
            await engine.aclose()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
