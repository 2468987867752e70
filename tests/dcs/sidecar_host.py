"""Runs one real DCS sidecar in its own process, in front of a scripted SGLang engine.

The sidecar is built exactly as ``python -m agentic_lora_dcs.sidecar`` builds it; only the
engine's HTTP surface is replaced, by :class:`agentic_lora.testing.sglang_engine.ScriptedSGLangEngine`
mounted with respx inside this process (the outer edge). ``/_test`` routes let the test process
read and steer that engine, and ``/_test/reset`` swaps in a brand-new sidecar and engine (as a
restart of both would, without paying for a new process). Prints one JSON line once listening.

    python -m tests.dcs.sidecar_host --name E0 --store-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import respx
from agentic_lora_dcs.receiver import Receiver
from agentic_lora_dcs.sidecar import SidecarConfig
from agentic_lora_dcs.sidecar import build_receiver
from agentic_lora_dcs.sidecar import create_app
from agentic_lora_dcs.sidecar import serve
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from tests.dcs.util import SIDECAR_TOKEN


class _ObservedCalls(list[tuple[EngineOp, dict[str, Any]]]):
    """The engine's call log, announcing each call as it is recorded (before any gate)."""

    def __init__(self, on_append: Callable[[], None]) -> None:
        super().__init__()
        self._on_append = on_append

    def append(self, item: tuple[EngineOp, dict[str, Any]]) -> None:
        super().append(item)
        self._on_append()


@dataclass
class _Generation:
    engine: ScriptedSGLangEngine
    admin: EngineAdminClient
    receiver: Receiver
    app: ASGIApp


class Host:
    """The current sidecar + engine pair, and the ASGI entry that forwards to it."""

    def __init__(self, name: str, store_root: Path, timeout: float, router: respx.Router) -> None:
        self.name = name
        self.store_root = store_root
        self.timeout = timeout
        self.router = router
        self.generation = 0
        self.gates: dict[str, asyncio.Event] = {}
        self.called = asyncio.Event()
        self.current = self._build()
        self.test_app = Starlette(
            routes=[
                Route("/_test/engine", self._state, methods=["GET"]),
                Route("/_test/engine/restart", self._restart, methods=["POST"]),
                Route("/_test/engine/script", self._script, methods=["POST"]),
                Route("/_test/engine/clear", self._clear, methods=["POST"]),
                Route("/_test/engine/gate", self._gate, methods=["POST"]),
                Route("/_test/engine/open", self._open, methods=["POST"]),
                Route("/_test/engine/wait", self._wait, methods=["POST"]),
                Route("/_test/receiver", self._receiver, methods=["GET"]),
                Route("/_test/reset", self._reset, methods=["POST"]),
            ]
        )

    def _build(self) -> _Generation:
        engine = ScriptedSGLangEngine(
            name=self.name,
            base_url=f"http://127.0.0.1:9/{self.name}/{self.generation}",
            # The fleet here holds many test versions at once; pinning limits are not under test.
            max_loras_per_batch=1000,
        )
        engine.calls = _ObservedCalls(self._announce)
        engine.mount(self.router)
        store = (
            self.store_root if self.generation == 0 else self.store_root / f"gen{self.generation}"
        )
        config = SidecarConfig(
            engine_url=engine.base_url,
            engine_name=self.name,
            store_dir=store,
            collective_timeout_s=self.timeout,
            token=SecretStr(SIDECAR_TOKEN),
        )
        admin = EngineAdminClient(engine.base_url, engine=self.name)
        receiver, _ = build_receiver(config, engine_client=admin)
        return _Generation(engine, admin, receiver, create_app(receiver, token=SIDECAR_TOKEN))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/_test/"):
            await self.test_app(scope, receive, send)
        else:
            await self.current.app(scope, receive, send)

    async def aclose(self) -> None:
        await self.current.receiver.aclose()
        await self.current.admin.aclose()

    def _engine_state(self) -> dict[str, Any]:
        engine = self.current.engine
        return {
            "adapters": {name: a.digest for name, a in engine.adapters.items()},
            "pinned": {name: a.pinned for name, a in engine.adapters.items()},
            "physical_loads": dict(engine.physical_loads),
            "physical_unloads": dict(engine.physical_unloads),
            "calls": [[str(op), body] for op, body in engine.calls],
            "restarts": engine.restarts,
        }

    async def _state(self, _: Request) -> Response:
        return JSONResponse(self._engine_state())

    async def _restart(self, _: Request) -> Response:
        self.current.engine.restart()
        return JSONResponse(self._engine_state())

    async def _script(self, request: Request) -> Response:
        body = await request.json()
        faults = [Fault(FaultKind(k)) for k in body["faults"]]
        self.current.engine.script(EngineOp(body["op"]), *faults)
        return JSONResponse({"queued": len(faults)})

    async def _clear(self, _: Request) -> Response:
        self.current.engine.clear_script()
        return JSONResponse({"cleared": True})

    def _announce(self) -> None:
        self.called.set()

    async def _gate(self, request: Request) -> Response:
        """Make the next call of ``op`` wait until ``/_test/engine/open`` names its gate."""
        body = await request.json()
        gate = self.gates.setdefault(body["gate"], asyncio.Event())
        self.current.engine.script(EngineOp(body["op"]), Fault.waiting_for(gate))
        return JSONResponse({"gate": body["gate"]})

    async def _open(self, request: Request) -> Response:
        self.gates[(await request.json())["gate"]].set()
        return JSONResponse({"opened": True})

    async def _wait(self, request: Request) -> Response:
        """Answer once the engine has recorded ``count`` calls of ``op`` (bounded)."""
        body = await request.json()
        op, count = EngineOp(body["op"]), int(body["count"])

        def reached() -> bool:
            return sum(1 for o, _ in self.current.engine.calls if o is op) >= count

        async def until_reached() -> None:
            # Calls are recorded on this event loop, so check-then-wait cannot miss one.
            while not reached():
                self.called.clear()
                await self.called.wait()

        await asyncio.wait_for(until_reached(), timeout=20.0)
        return JSONResponse({"reached": True})

    async def _receiver(self, _: Request) -> Response:
        return JSONResponse({"stash_bytes": self.current.receiver.stash_bytes()})

    async def _reset(self, _: Request) -> Response:
        await self.aclose()
        self.generation += 1
        self.current = self._build()
        return JSONResponse(
            {"sidecar_id": self.current.receiver.sidecar_id, "store_dir": str(self._store())}
        )

    def _store(self) -> Path:
        return (
            self.store_root if self.generation == 0 else self.store_root / f"gen{self.generation}"
        )


def _exit_with(parent: int) -> None:
    # An interrupted test run (pytest killed) cannot stop this host; once it is re-parented, its
    # test is gone, so it goes too instead of holding a port and a store for ever.
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--store-dir", required=True, type=Path)
    parser.add_argument("--collective-timeout", type=float, default=20.0)
    args = parser.parse_args()

    async def run() -> None:
        # Only the scripted engines' URLs are mocked; any other request would be a test bug.
        with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
            host = Host(args.name, args.store_dir, args.collective_timeout, router)
            config = SidecarConfig(
                engine_url="http://127.0.0.1:9/",
                store_dir=args.store_dir,
                token=SecretStr(SIDECAR_TOKEN),
            )

            def ready(port: int) -> None:
                line = {
                    "url": f"http://127.0.0.1:{port}",
                    "sidecar_id": host.current.receiver.sidecar_id,
                }
                print(json.dumps(line), flush=True)

            try:
                await serve(config, host, on_ready=ready)
            finally:
                await host.aclose()

    asyncio.run(run())


if __name__ == "__main__":
    main()
