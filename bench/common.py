"""What every benchmark script shares: percentiles, the machine description, output, the engines.

* :func:`summarize` gives count / p50 / p95 / p99 / mean / max of a sample list (linear
  interpolation, the same method as ``statistics.quantiles(method="inclusive")``).
* :func:`machine` describes where a run happened, including the load average before it started
  (the machine is shared: read ratios from one run, not absolute numbers across runs).
* :func:`write_result` writes ``bench/out/<name>.json``; :func:`print_table` prints aligned rows.
* :class:`InstantEngine` runs ``bench/instant_engine.py`` in its own process on a free loopback
  port: an engine that answers ``/generate`` at once, for pure-overhead measurements.
* :func:`publish_in_registry` commits a version by registry verbs alone, for engines that
  load nothing (the instant engine, respx); :func:`instant_setup` is the instant engine with
  such a registry, an engine transport to it and :func:`direct_client`, the product's engine
  client with nothing of ours on top; :func:`sglang_setup` is one real SGLang engine with adapter
  A published through a Deployment, and a :func:`direct_client`.
* :func:`interleaved_order` gives the ABBA block order the scripts use so that slow drifts of a
  noisy machine (another job starting, thermal changes) hit every variant alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import Self

import aiohttp
import httpx
import numpy as np
from httpx_aiohttp import AiohttpTransport

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.foundation.http_limits import ENGINE_KEEPALIVE_EXPIRY
from agentic_lora.foundation.http_limits import engine_limits
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.session import Versioning
from agentic_lora.testing.publish import publish_by_verbs

__all__ = [
    "BENCH_DIR",
    "OUT_DIR",
    "REPO_ROOT",
    "InstantEngine",
    "InstantSetup",
    "SglangSetup",
    "Summary",
    "add_example_agents_to_path",
    "direct_client",
    "engine_log_dir",
    "free_port",
    "instant_setup",
    "interleaved_order",
    "machine",
    "max_gap",
    "print_table",
    "publish_in_registry",
    "rss_mb",
    "sglang_setup",
    "summarize",
    "terminate",
    "write_result",
]

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
OUT_DIR = BENCH_DIR / "out"


@dataclass(frozen=True, slots=True)
class Summary:
    """Distribution of one sample list, in the samples' unit."""

    count: int
    p50: float
    p95: float
    p99: float
    mean: float
    maximum: float

    def scaled(self, factor: float) -> Summary:
        """The same summary in another unit (e.g. ``1e6`` for seconds to microseconds)."""
        return Summary(
            self.count,
            self.p50 * factor,
            self.p95 * factor,
            self.p99 * factor,
            self.mean * factor,
            self.maximum * factor,
        )

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready fields."""
        return asdict(self)


def summarize(samples: Iterable[float]) -> Summary:
    """The summary of ``samples``; an empty list gives NaN percentiles and count 0."""
    data = np.fromiter(samples, dtype=float)
    if data.size == 0:
        nan = float("nan")
        return Summary(0, nan, nan, nan, nan, nan)
    p50, p95, p99 = np.percentile(data, [50, 95, 99])
    return Summary(
        int(data.size), float(p50), float(p95), float(p99), float(data.mean()), float(data.max())
    )


def median_block_ratio(variant: Iterable[float], baseline: Iterable[float]) -> float:
    """The median over rounds of ``variant``'s k-th block figure divided by ``baseline``'s k-th
    (NaN when no pair counts). Blocks of one round ran within one interleaved round of each
    other, so a drift or a neighbour's burst that lasts a round moves both sides of a pair: it
    moves this less than a ratio of pooled figures. A pair with no baseline figure (0) or no
    variant figure (NaN) is left out."""
    return summarize(v / b for b, v in zip(baseline, variant, strict=False) if b > 0 and v == v).p50


def max_gap(completions: Sequence[float], start: float, end: float) -> float:
    """Longest interval in ``[start, end]`` in which no request completed.

    The window's edges count: a window whose first completion comes 2 s after it opened has a
    2 s gap even if completions are dense afterwards.
    """
    inside = sorted(t for t in completions if start <= t <= end)
    edges = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def interleaved_order(variants: Sequence[str], blocks: int) -> list[str]:
    """``blocks`` rounds of every variant, odd rounds reversed (A B C, C B A, A B C, ...)."""
    order: list[str] = []
    for block in range(blocks):
        order.extend(variants if block % 2 == 0 else list(reversed(variants)))
    return order


def rss_mb() -> float:
    """Resident set size of this process in MiB (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024 / 1024, 1)
    return float("nan")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Where this run happens: CPU, cores, RAM, kernel, Python, key libraries, current load."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "ram_gb": _mem_total_gb(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "libraries": {
            name: _version(name)
            for name in ("httpx", "aiohttp", "httpx-aiohttp", "pydantic", "tenacity", "respx")
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``bench/out/<name>.json`` and return the path."""
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Print ``rows`` under ``headers``, first column left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers], *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.0f}"
    return str(value)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def terminate(process: subprocess.Popen[Any], *, grace: float) -> None:
    """Stop ``process``: SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def add_example_agents_to_path() -> None:
    """Make ``examples/agents`` importable (``agentic_lora_agent`` is an example, not installed)."""
    agents = str(REPO_ROOT / "examples" / "agents")
    if agents not in sys.path:
        sys.path.insert(0, agents)


def engine_log_dir() -> Path:
    """A fresh directory under ``bench/out/engine-logs`` for one run's SGLang logs."""
    path = OUT_DIR / "engine-logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


class InstantEngine:
    """``bench/instant_engine.py`` in a child process on a free loopback port (see module doc).

    ``command`` replaces the script's argument list (``--port PORT`` is appended): a benchmark
    that needs more routes serves ``instant_engine.build_app()`` with its own additions.
    """

    def __init__(
        self, *, startup_timeout: float = 30.0, command: Sequence[str] | None = None
    ) -> None:
        self.port = free_port()
        self._startup_timeout = startup_timeout
        self._command = (
            list(command) if command is not None else [str(BENCH_DIR / "instant_engine.py")]
        )
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Launch the server and wait (bounded) until ``/health`` answers."""
        self._process = subprocess.Popen(
            [sys.executable, *self._command, "--port", str(self.port)],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self._startup_timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"instant engine exited with {self._process.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("instant engine did not become healthy")
                time.sleep(0.05)

    def stop(self) -> None:
        """Terminate the server (and kill it if it does not exit in a few seconds)."""
        process, self._process = self._process, None
        if process is not None:
            terminate(process, grace=5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def publish_in_registry(
    registry: LocalRegistry, engine: str, version_id: str = "bench"
) -> str:
    """Commit one version by registry verbs alone (for engines that load nothing); its lora_name."""
    r = await publish_by_verbs(
        registry, version_id, (engine,), digest="cd" * 32, incarnation="bench"
    )
    return r.lora_name


def direct_aiohttp_client() -> aiohttp.ClientSession:
    """The client the ``aiohttp`` direct variants use: a bare ``aiohttp.ClientSession`` with the
    pool, keep-alive expiry and timeouts of the transport's default stack, nothing of ours on top
    (the same HTTP stack as the versioned path, so the gap to it is ours alone)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=512, keepalive_timeout=ENGINE_KEEPALIVE_EXPIRY),
        timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0, sock_read=600.0),
        trust_env=False,
    )


def direct_client() -> httpx.AsyncClient:
    """The client a direct variant uses: the transport, pool limits and timeouts EngineTransport
    builds (idle connections dropped before the engine's keep-alive ends), nothing of ours on top."""
    return httpx.AsyncClient(
        transport=AiohttpTransport(retries=0, limits=engine_limits(512), trust_env=False),
        timeout=httpx.Timeout(600.0, connect=5.0, pool=5.0),
        follow_redirects=False,
        trust_env=False,
    )


@dataclass(frozen=True)
class InstantSetup:
    """What :func:`instant_setup` yields."""

    engine: EngineRef
    registry: LocalRegistry
    lora_name: str
    transport: EngineTransport
    direct: httpx.AsyncClient
    raw: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def instant_setup() -> AsyncIterator[InstantSetup]:
    """The instant engine in its own process, a LocalRegistry with one committed version, an
    EngineTransport to the engine and a :func:`direct_client`; all closed on exit."""
    with InstantEngine() as server:
        ref = EngineRef("e0", server.base_url)
        registry = LocalRegistry(engines=("e0",), capacity=2)
        lora_name = await publish_in_registry(registry, "e0")
        transport = EngineTransport([ref])
        try:
            async with direct_client() as direct, direct_aiohttp_client() as raw:
                yield InstantSetup(ref, registry, lora_name, transport, direct, raw)
        finally:
            await transport.aclose()
            await registry.aclose()


def fleet_settings(fleet: Any, **overrides: Any) -> Any:
    """Versioned settings for a harness :class:`~agentic_lora_harness.engines.EngineFleet`:
    capacity 2 and the harness's LoRA slot options (3 loaded, 3 per batch), ``overrides`` on top."""
    from agentic_lora.config import load_settings

    values: dict[str, Any] = {
        "enable_versioned_lora_publication": True,
        "engines": [f"{name}={url}" for name, url in fleet.engines],
        "capacity": 2,
        "base_model_name": fleet.served_model_name,
        "engine_max_loaded_loras": 3,
        "engine_max_loras_per_batch": 3,
        **overrides,
    }
    return load_settings(**values)


@dataclass(frozen=True)
class SglangSetup:
    """What :func:`sglang_setup` yields."""

    engine: EngineRef
    lora_name: str
    versioning: Versioning
    direct: httpx.AsyncClient
    raw: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def sglang_setup(name: str) -> AsyncIterator[SglangSetup]:
    """One real SGLang engine (harness), adapter A published through a Deployment (HTTP push) and
    a :func:`direct_client`; all stopped on exit. ``name`` names the adapter store's directory."""
    from agentic_lora_harness.engine_env import ensure_engine_env
    from agentic_lora_harness.engines import EngineFleet
    from agentic_lora_harness.fixture import build_fixture

    from agentic_lora.adapters.snapshot import AdapterSnapshot
    from agentic_lora.assembly.deployment import Deployment

    env = await asyncio.to_thread(ensure_engine_env)
    fixture = await asyncio.to_thread(build_fixture)
    async with EngineFleet(env, fixture, count=1, log_dir=engine_log_dir()) as fleet:
        settings = fleet_settings(fleet)
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as store:
            deployment = Deployment.from_settings(settings, backend_options={"store_root": store})
            async with deployment, direct_client() as direct, direct_aiohttp_client() as raw:
                result = await deployment.publish(
                    f"A-{uuid.uuid4().hex[:8]}",
                    AdapterSnapshot.from_peft_dir(fixture.adapter("A")),
                )
                if not result.ok or result.lora_name is None:
                    raise RuntimeError(f"publication failed: {result}")
                versioning = deployment.versioning
                yield SglangSetup(versioning.engines[0], result.lora_name, versioning, direct, raw)
