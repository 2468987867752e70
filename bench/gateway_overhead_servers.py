"""The processes bench/gateway_overhead.py measures through, each run as a child process.

* ``--instant-engine --port PORT``: ``bench/instant_engine.py``'s app plus an instant
  ``/v1/chat/completions`` (one fixed reply in OpenAI's shape);
* ``--gateway SPEC``: the gateway (``Gateway`` under uvicorn as ``agentic-lora serve`` runs it: no
  lifespan, no access log, its own logging) in front of ``SPEC.engine_url``, which publishes
  adapter ``SPEC.adapter`` at start (HTTP push), or for the instant engine commits a version by
  registry verbs; ``SPEC.profile`` runs it under pyinstrument;
* both proxies parse HTTP with ``SPEC.http`` (uvicorn's ``http``: ``auto``, the default, takes
  ``httptools`` when it is installed and ``h11`` otherwise);
* ``--floor SPEC``: the thinnest proxy on the gateway's stack (FastAPI under uvicorn, one route
  that decodes the body, posts it with a bare ``aiohttp.ClientSession`` and answers the decoded
  reply).

:func:`proxy_process` starts the gateway or the floor and waits until it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from common import OUT_DIR
from common import terminate
from fastapi import Request  # resolved at run time by FastAPI in the floor proxy's route

__all__ = ["BASE_MODEL", "main", "proxy_process"]

BASE_MODEL = "bench-model"  # the instant engine's; SGLang's comes from the harness fixture


def _serve_instant_engine(port: int) -> None:
    from aiohttp import web
    from instant_engine import build_app

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return web.json_response(
            {
                "id": "chatcmpl-instant",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", BASE_MODEL) if isinstance(body, dict) else BASE_MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": " ok"},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )

    app = build_app()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


class _Server(uvicorn.Server):
    """uvicorn with SIGTERM as ``agentic-lora serve`` handles it: the server stops, the code after
    ``serve()`` runs (uvicorn's own handling re-raises the signal once it has shut down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._exit)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    def _exit(self) -> None:
        self.should_exit = True


def _uvicorn_config(app: Any, spec: dict[str, Any]) -> uvicorn.Config:
    """How every proxy variant is served (the same server settings, so only the app differs):
    loopback, no access log or lifespan, uvicorn's logging left alone, ``spec``'s HTTP parser."""
    return uvicorn.Config(
        app,
        host="127.0.0.1",
        port=spec["port"],
        log_config=None,
        access_log=False,
        lifespan="off",
        http=spec.get("http", "auto"),
    )


def _serve_gateway(spec: dict[str, Any]) -> None:
    """Child process: the gateway on 127.0.0.1:spec.port in front of spec.engine_url."""
    import logging
    import tempfile

    from agentic_lora_http.backend import HttpPushBackend
    from common import publish_in_registry

    from agentic_lora.adapters.snapshot import AdapterSnapshot
    from agentic_lora.cli.logs import configure_logging
    from agentic_lora.config import load_settings
    from agentic_lora.engines.backends import EngineRef
    from agentic_lora.gateway.app import Gateway

    class _InstantBackend(HttpPushBackend):
        # The instant engine reports no incarnation; the version was committed under this one.
        async def incarnation(self, engine: EngineRef) -> str:
            return "bench"

    async def main() -> None:
        settings = load_settings(
            enable_versioned_lora_publication=True,
            engines=[f"{spec['engine_name']}={spec['engine_url']}"],
            capacity=2,
            base_model_name=spec["base_model"],
            engine_max_loaded_loras=3,
            engine_max_loras_per_batch=3,
        )
        store = tempfile.mkdtemp(prefix="bench-gateway-overhead-")
        instant = spec["adapter"] is None
        backend = _InstantBackend(store_root=store) if instant else HttpPushBackend(store)
        gateway = await Gateway.from_settings(settings, backend=backend)
        async with gateway:
            if instant:
                await publish_in_registry(gateway.deployment.registry, spec["engine_name"])
            else:
                snapshot = AdapterSnapshot.from_peft_dir(Path(spec["adapter"]))
                result = await gateway.deployment.publish(f"A-{uuid.uuid4().hex[:8]}", snapshot)
                if not result.ok:
                    raise RuntimeError(f"publication failed: {result}")
            # As `agentic-lora serve` runs it: no lifespan, no access log, its logging.
            configure_logging(logging.getLevelName(spec["log_level"]), "text")
            config = _uvicorn_config(gateway.app, spec)
            profile = spec.get("profile")
            if not profile:
                await _Server(config).serve()
                return
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="disabled")
            profiler.start()
            try:
                await _Server(config).serve()
            finally:
                profiler.stop()
                # The call tree, then each function's own time (where the CPU goes).
                text = profiler.output_text(show_all=True) + profiler.output_text(flat=True)
                await asyncio.to_thread(Path(profile).write_text, text)

    asyncio.run(main())


def _serve_floor(spec: dict[str, Any]) -> None:
    """Child process: the thinnest proxy on the gateway's stack (see module doc)."""
    import aiohttp
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.responses import Response

    app = FastAPI()
    url = f"{spec['engine_url']}/v1/chat/completions"
    held: list[aiohttp.ClientSession] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        if not held:
            held.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)))
        body = json.loads(await request.body())
        async with held[0].post(url, json=body) as answer:
            reply = await answer.json()
            return JSONResponse(reply, status_code=answer.status)

    @app.get("/health/live")
    async def live() -> Response:
        return Response()

    config = _uvicorn_config(app, spec)
    asyncio.run(_Server(config).serve())


@contextlib.contextmanager
def proxy_process(mode: str, spec: dict[str, Any]) -> Any:
    """The ``gateway`` or ``floor`` child, started and healthy; yields ``(base_url, pid)``."""
    log = OUT_DIR / f"gateway_overhead.{mode}.log"
    OUT_DIR.mkdir(exist_ok=True)
    with log.open("ab") as err:
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__)), f"--{mode}", json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        url = f"http://127.0.0.1:{spec['port']}"
        deadline = time.monotonic() + 300
        with httpx.Client(trust_env=False, timeout=2.0) as probe:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if probe.get(f"{url}/health/live").status_code == 200:
                        break
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {mode} did not start (see {log})")
                time.sleep(0.2)
        yield url, child.pid
    finally:
        terminate(child, grace=30)


def main() -> None:
    """Serve one of the three (see module doc) until terminated."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--instant-engine", action="store_true")
    p.add_argument("--port", type=int)
    p.add_argument("--gateway", metavar="SPEC")
    p.add_argument("--floor", metavar="SPEC")
    a = p.parse_args()
    if a.instant_engine:
        _serve_instant_engine(a.port)
    elif a.gateway:
        _serve_gateway(json.loads(a.gateway))
    elif a.floor:
        _serve_floor(json.loads(a.floor))
    else:
        p.error("one of --instant-engine, --gateway, --floor")


if __name__ == "__main__":
    main()
