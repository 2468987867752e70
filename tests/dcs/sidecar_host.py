"""Runs one real DCS sidecar in its own process, in front of a scripted SGLang engine.

The sidecar is built exactly as ``python -m agentic_lora_dcs.sidecar`` builds it; only the
engine's HTTP surface is replaced, by :class:`agentic_lora.testing.sglang_engine.ScriptedSGLangEngine`
mounted with respx inside this process (the outer edge). A few ``/_test`` routes let the test
process read and steer that engine. Prints one JSON line with the ports once listening.

    python -m tests.dcs.sidecar_host --name E0 --store-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import respx
from agentic_lora_dcs.sidecar import SidecarConfig, build_receiver, create_app, serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentic_lora.engine_admin import EngineAdminClient
from agentic_lora.testing.sglang_engine import EngineOp, Fault, FaultKind, ScriptedSGLangEngine


def _engine_state(engine: ScriptedSGLangEngine) -> dict[str, Any]:
    return {
        "adapters": {name: a.digest for name, a in engine.adapters.items()},
        "pinned": {name: a.pinned for name, a in engine.adapters.items()},
        "physical_loads": dict(engine.physical_loads),
        "physical_unloads": dict(engine.physical_unloads),
        "calls": [[str(op), body] for op, body in engine.calls],
        "restarts": engine.restarts,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--store-dir", required=True, type=Path)
    parser.add_argument("--collective-timeout", type=float, default=20.0)
    args = parser.parse_args()

    engine = ScriptedSGLangEngine(
        name=args.name,
        base_url=f"http://127.0.0.1:9/{args.name}",
        # The fleet here holds many test versions at once; pinning limits are not under test.
        max_loras_per_batch=1000,
    )
    config = SidecarConfig(
        engine_url=engine.base_url,
        engine_name=args.name,
        store_dir=args.store_dir,
        collective_timeout_s=args.collective_timeout,
    )
    admin = EngineAdminClient(engine.base_url, engine=args.name)
    receiver, _ = build_receiver(config, engine_client=admin)

    async def state(_: Request) -> Response:
        return JSONResponse(_engine_state(engine))

    async def restart(_: Request) -> Response:
        engine.restart()
        return JSONResponse(_engine_state(engine))

    async def script(request: Request) -> Response:
        body = await request.json()
        engine.script(EngineOp(body["op"]), *(Fault(FaultKind(k)) for k in body["faults"]))
        return JSONResponse({"queued": len(body["faults"])})

    async def receiver_state(_: Request) -> Response:
        return JSONResponse({"stash_bytes": receiver.stash_bytes()})

    app = create_app(
        receiver,
        extra_routes=[
            Route("/_test/engine", state, methods=["GET"]),
            Route("/_test/engine/restart", restart, methods=["POST"]),
            Route("/_test/engine/script", script, methods=["POST"]),
            Route("/_test/receiver", receiver_state, methods=["GET"]),
        ],
    )

    def ready(port: int) -> None:
        line = {
            "url": f"http://127.0.0.1:{port}",
            "sidecar_id": receiver.sidecar_id,
            "rendezvous_port": receiver.rendezvous_port,
        }
        print(json.dumps(line), flush=True)

    async def run() -> None:
        # Only the engine's base URL is mocked; anything else would be a test bug.
        with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
            engine.mount(router)
            try:
                await serve(config, app, on_ready=ready)
            finally:
                await admin.aclose()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
