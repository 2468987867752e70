"""Helpers for the DCS tests: deterministic adapters and sidecar processes."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.snapshot import TensorBlob
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.foundation.identity import make_lora_name

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
#: Small enough that every test adapter moves in several buckets (several collectives).
BUCKET_BYTES = 4096
#: The control token every test sidecar is started with (tests only; never a real secret).
SIDECAR_TOKEN = "dcs-test-control-token"


def make_snapshot(
    seed: int, *, layers: int = 3, hidden: int = 64, rank: int = 4
) -> AdapterSnapshot:
    """A small, valid, seeded LoRA adapter (F32, q/v projections)."""
    rng = np.random.default_rng(seed)
    blobs = []
    for layer in range(layers):
        for module in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.standard_normal((rank, hidden), dtype=np.float32)
            b = rng.standard_normal((hidden, rank), dtype=np.float32)
            blobs.append(TensorBlob(f"{base}.lora_A.weight", "F32", (rank, hidden), a.tobytes()))
            blobs.append(TensorBlob(f"{base}.lora_B.weight", "F32", (hidden, rank), b.tobytes()))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8,
        "target_modules": ["v_proj", "q_proj"],
        "base_model_name_or_path": "tiny-qwen3",
    }
    return AdapterSnapshot.from_blobs(config, blobs)


def target_for(snapshot: AdapterSnapshot, version_id: str, attempt: int = 1) -> PublicationTarget:
    return PublicationTarget(
        version_id=version_id,
        digest=snapshot.digest,
        lora_name=make_lora_name("policy_lora", 0, version_id, snapshot.digest),
        attempt=attempt,
    )


@dataclass
class SidecarProcess:
    """One ``tests.dcs.sidecar_host`` process (real sidecar, scripted engine behind it)."""

    name: str
    store_dir: Path
    process: subprocess.Popen[str]
    url: str
    sidecar_id: str

    @property
    def engine(self) -> EngineRef:
        return EngineRef(self.name, f"http://127.0.0.1:9/{self.name}")

    @classmethod
    def start(
        cls, name: str, store_dir: Path, *, collective_timeout: float = 20.0
    ) -> SidecarProcess:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "plugins")]))
        env["OMP_NUM_THREADS"] = "1"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.dcs.sidecar_host",
                "--name",
                name,
                "--store-dir",
                str(store_dir),
                "--collective-timeout",
                str(collective_timeout),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = _read_line(process, START_TIMEOUT_S)
        info = json.loads(line)
        return cls(name, store_dir, process, info["url"], info["sidecar_id"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        if self.process.stdout is not None:
            self.process.stdout.close()

    # --- test controls (the scripted engine and the receiver's internals) ----------------------

    def reset(self, http: httpx.Client) -> None:
        """Swap in a brand-new sidecar and engine inside the same process (fresh ledger)."""
        reply = http.post(f"{self.url}/_test/reset").raise_for_status().json()
        self.sidecar_id = reply["sidecar_id"]
        self.store_dir = Path(reply["store_dir"])

    async def engine_state(self, http: httpx.AsyncClient) -> dict[str, Any]:
        return (await http.get(f"{self.url}/_test/engine")).raise_for_status().json()  # type: ignore[no-any-return]

    async def restart_engine(self, http: httpx.AsyncClient) -> None:
        (await http.post(f"{self.url}/_test/engine/restart")).raise_for_status()

    async def script(self, http: httpx.AsyncClient, op: str, *faults: str) -> None:
        body = {"op": op, "faults": list(faults)}
        (await http.post(f"{self.url}/_test/engine/script", json=body)).raise_for_status()

    async def stash_bytes(self, http: httpx.AsyncClient) -> int:
        reply = (await http.get(f"{self.url}/_test/receiver")).raise_for_status().json()
        return int(reply["stash_bytes"])

    async def status(self, http: httpx.AsyncClient) -> dict[str, Any]:
        return (await http.get(f"{self.url}/status")).raise_for_status().json()  # type: ignore[no-any-return]

    async def attempt(
        self, http: httpx.AsyncClient, lora_name: str, attempt: int
    ) -> dict[str, Any] | None:
        for view in (await self.status(http))["attempts"]:
            if view["lora_name"] == lora_name and view["attempt"] == attempt:
                return view  # type: ignore[no-any-return]
        return None


async def state_of(
    sidecar: SidecarProcess, http: httpx.AsyncClient, lora_name: str, attempt: int
) -> str | None:
    """The sidecar's state for one attempt (None: it has no record of it)."""
    view = await sidecar.attempt(http, lora_name, attempt)
    return None if view is None else str(view["state"])


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            process.kill()
            raise RuntimeError(f"sidecar did not report ready within {timeout}s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"sidecar exited before it was ready (rc={process.wait()})")
    return line


class EdgeTransport(httpx.AsyncBaseTransport):
    """The publisher's network, scripted: records, duplicates, loses replies, runs hooks.

    Wraps a real loopback transport; every scripted behaviour happens on the wire, so the
    sidecar sees exactly what a flaky network would deliver.
    """

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.sent: list[tuple[str, bytes]] = []
        self._duplicate: set[str] = set()
        self._lose: dict[str, int] = {}
        self._lose_after: dict[str, int] = {}
        self._hooks: dict[str, list[Any]] = {}

    def duplicate(self, path: str) -> None:
        """Deliver every request to ``path`` twice; the caller sees the second reply."""
        self._duplicate.add(path)

    def lose_reply(self, path: str, *, after: int = 0) -> None:
        """Deliver the request, then drop its reply (once, skipping ``after`` requests first)."""
        self._lose[path] = self._lose.get(path, 0) + 1
        self._lose_after[path] = after

    def before(self, path: str, hook: Any) -> None:
        """Await ``hook()`` before the next request to ``path`` goes out."""
        self._hooks.setdefault(path, []).append(hook)

    def bodies(self, path: str) -> list[bytes]:
        return [body for p, body in self.sent if p == path]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = await request.aread()
        hooks = self._hooks.get(path)
        if hooks:
            await hooks.pop(0)()
        self.sent.append((path, body))
        response = await self._deliver(request)
        if path in self._duplicate:
            await response.aclose()
            self.sent.append((path, body))
            response = await self._deliver(request)
        if self._lose.get(path):
            if self._lose_after[path] > 0:
                self._lose_after[path] -= 1
            else:
                self._lose[path] -= 1
                await response.aclose()
                raise httpx.ReadError("reply lost (scripted)", request=request)
        return response

    async def _deliver(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=content)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def resend(http: httpx.AsyncClient, url: str, body: bytes) -> httpx.Response:
    """Post a control message's recorded JSON ``body`` again, as a late or replayed copy."""
    return await http.post(url, content=body, headers={"content-type": "application/json"})
