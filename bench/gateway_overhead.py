"""The gateway's own cost: the ``openai`` client through the gateway versus straight to the engine.

Three variants send the same chat completion, interleaved block by block (ABBA) in one run:

* ``direct``: ``openai.AsyncOpenAI`` straight to the engine's ``/v1/chat/completions``, the
  adapter named by hand (``model="<base>:<lora_name>"``);
* ``floor``: the same client through the thinnest proxy on the gateway's own stack, for scale:
  FastAPI under uvicorn, one route that reads the body, decodes it, posts it to the engine with a
  bare ``aiohttp.ClientSession`` and answers the decoded reply (no checks, no Session, no log);
* ``gateway``: the same client against the gateway (``Gateway`` under uvicorn, as ``agentic-lora
  serve`` runs it, in a process of its own on loopback), its credential naming the Session; the
  gateway checks the body, dispatches it in the Session (bound at the warm-up, so each measured
  request is a later turn of a bound Session) and answers with the reply and its provenance.

With ``--h11-gateway`` (instant engine) a fourth variant, ``gateway_h11``, is a second gateway
process whose uvicorn parses HTTP with the pure-Python ``h11`` instead of ``--http``'s parser:
the parser's share of the gateway's CPU, weighed within one interleaved run.

Each of ``--concurrency`` workers has its own client per variant (one connection each) and its own
Session; a block is every worker sending ``--requests`` (at 1) or ``--requests-at-scale``
requests one after the other. Latency is timed around ``chat.completions.create``.

Engines (``--engine``):

* ``sglang``: one real SGLang engine from the test harness (the fleet of the other benchmarks);
  the gateway publishes adapter A on it at start (HTTP push). Goal: gateway / direct p50 at most
  1.03 at 1 and 64 concurrent. The pooled p50 ratio is the goal's figure; the paired one (each
  round's gateway block p50 over the same round's direct block, median over rounds) is printed
  beside it.
* ``instant``: ``bench/instant_engine.py``'s app plus an instant ``/v1/chat/completions`` (one
  fixed reply), in its own process; a version is committed by registry verbs. What is left is
  pure overhead. Goal: gateway CPU per request at most 150 us.

Gateway CPU per request: the gateway process's CPU time (user + system, ``psutil``, read before
and after every block) over the gateway blocks, less its idle rate times their length, divided
by their requests. The idle rate is its CPU per second during the same run's other blocks,
when no request reaches it (timers, the reclaimer, the idle-Session expiry). The floor proxy's
CPU per request is measured the same way. The client's CPU is
its own process's (``time.process_time``), so no share of it is counted; engine CPU is outside
both. The gateway logs at ``--log-level`` (INFO by default, as ``agentic-lora serve``) to
``bench/out/gateway_overhead.gateway.log``.

Real engines: run under ``flock /tmp/agentic-lora-engines.lock``.

Usage: python bench/gateway_overhead.py [--engine instant|sglang|both] [--concurrency 1,64] [--http auto]
       [--blocks 8] [--requests 50] [--requests-at-scale 4] [--log-level INFO] [--h11-gateway]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from common import InstantEngine
from common import free_port
from common import interleaved_order
from common import machine
from common import median_block_ratio
from common import print_table
from common import summarize
from common import write_result
from gateway_overhead_servers import BASE_MODEL
from gateway_overhead_servers import proxy_process

__all__ = [
    "CPU_GOAL_US",
    "P50_RATIO_GOAL",
    "Block",
    "check_goals",
    "goal_lines",
    "level_report",
    "main",
    "parse_levels",
    "proxy_cpu_us",
]

P50_RATIO_GOAL = 1.03
CPU_GOAL_US = 150.0
VARIANTS = ("direct", "floor", "gateway", "gateway_h11")
# The variants that run through a process of ours (gateway_h11 with --h11-gateway only).
PROXIES = ("floor", "gateway", "gateway_h11")
MESSAGES = [{"role": "user", "content": "Say hello."}]
SERVERS = Path(__file__).resolve().parent / "gateway_overhead_servers.py"


# --- pure figures (tested in tests/bench/test_gateway_overhead.py) ------------------------------


@dataclass
class Block:
    """One block of one variant: its latencies (s), wall time, the client's CPU and each proxy
    process's CPU during the block (s)."""

    variant: str
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    client_cpu: float = 0.0
    proxy_cpu: dict[str, float] = field(default_factory=dict)
    failures: int = 0
    first_error: str | None = None


def parse_levels(text: str) -> list[int]:
    """``"1,64"`` -> ``[1, 64]``; every level a positive whole number."""
    levels = [int(v) for v in text.split(",") if v.strip()]
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"concurrency levels must be positive: {text!r}")
    return levels


def proxy_cpu_us(blocks: Sequence[Block], proxy: str = "gateway") -> dict[str, float]:
    """``proxy``'s CPU per request (us): raw, its idle rate (us of CPU per s of wall during the
    other variants' blocks) and the request figure with that idle rate taken out."""
    busy = [b for b in blocks if b.variant == proxy]
    idle = [b for b in blocks if b.variant != proxy and proxy in b.proxy_cpu]
    requests = sum(len(b.latencies) + b.failures for b in busy)
    spent = sum(b.proxy_cpu.get(proxy, 0.0) for b in busy)
    idle_wall = sum(b.wall for b in idle)
    idle_rate = sum(b.proxy_cpu[proxy] for b in idle) / idle_wall if idle_wall > 0 else 0.0
    busy_wall = sum(b.wall for b in busy)
    nan = float("nan")
    return {
        "raw_us_per_request": spent / requests * 1e6 if requests else nan,
        "idle_us_per_s": idle_rate * 1e6,
        "us_per_request": (spent - idle_rate * busy_wall) / requests * 1e6 if requests else nan,
    }


def level_report(blocks: Sequence[Block]) -> dict[str, Any]:
    """Per variant: latency summary (ms), per-block p50s, client CPU per request (us), requests/s,
    failures; for each proxy variant also its p50 ratios to ``direct`` (pooled and paired) and its
    process's CPU per request."""
    variants: dict[str, Any] = {}
    for name in VARIANTS:
        mine = [b for b in blocks if b.variant == name]
        if not mine:
            continue
        done = sum(len(b.latencies) for b in mine)
        wall = sum(b.wall for b in mine)
        variants[name] = {
            "latency_ms": summarize(x for b in mine for x in b.latencies).scaled(1e3).as_dict(),
            "block_p50_ms": [summarize(b.latencies).p50 * 1e3 for b in mine],
            "client_cpu_us_per_request": sum(b.client_cpu for b in mine) / done * 1e6
            if done
            else float("nan"),
            "requests_per_s": done / wall if wall > 0 else float("nan"),
            "failures": sum(b.failures for b in mine),
            "first_error": next((b.first_error for b in mine if b.first_error), None),
        }
    d = variants["direct"]
    for name in PROXIES:
        v = variants.get(name)
        if v is None:
            continue
        v["p50_ratio"] = v["latency_ms"]["p50"] / d["latency_ms"]["p50"]
        v["p50_ratio_paired"] = median_block_ratio(v["block_p50_ms"], d["block_p50_ms"])
        v["p99_ratio"] = v["latency_ms"]["p99"] / d["latency_ms"]["p99"]
        v["proxy_cpu"] = proxy_cpu_us(blocks, name)
    return {"variants": variants}


def check_goals(engine: str, levels: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each goal's figure beside it: the p50 ratio on real SGLang, the gateway's CPU on the
    instant engine (the other engine's figures are printed, not judged)."""
    checks: dict[str, dict[str, Any]] = {}
    for conc, level in levels.items():
        gateway = level["variants"]["gateway"]
        if engine == "sglang":
            ratio = gateway["p50_ratio"]
            checks[f"sglang c={conc}: gateway/direct p50 <= {P50_RATIO_GOAL}"] = {
                "value": ratio,
                "goal": P50_RATIO_GOAL,
                "holds": ratio <= P50_RATIO_GOAL,
            }
        else:
            cpu = gateway["proxy_cpu"]["us_per_request"]
            checks[f"instant c={conc}: gateway CPU per request <= {CPU_GOAL_US:.0f} us"] = {
                "value": cpu,
                "goal": CPU_GOAL_US,
                "holds": cpu <= CPU_GOAL_US,
            }
    return checks


def goal_lines(checks: dict[str, dict[str, Any]]) -> list[str]:
    """``HOLDS``/``MISSED`` lines, one per goal, figure beside goal."""
    return [
        f"  {'HOLDS ' if c['holds'] else 'MISSED'}  {name}: {c['value']:.3f}"
        for name, c in checks.items()
    ]


def level_rows(engine: str, levels: dict[int, dict[str, Any]]) -> list[list[object]]:
    """Table rows: one per (concurrency, variant)."""
    rows: list[list[object]] = []
    for conc, level in levels.items():
        for name, v in level["variants"].items():
            lat = v["latency_ms"]
            nan = float("nan")
            cpu = v["proxy_cpu"]["us_per_request"] if "proxy_cpu" in v else nan
            rows.append(
                [f"{engine} c={conc} {name}", lat["count"], lat["p50"], lat["p99"],
                 v.get("p50_ratio", nan), v.get("p50_ratio_paired", nan),
                 v["client_cpu_us_per_request"], cpu, v["requests_per_s"], v["failures"]]
            )  # fmt: skip
    return rows


TABLE_HEADERS = [
    "variant",
    "requests",
    "p50 ms",
    "p99 ms",
    "p50 / direct",
    "paired",
    "client CPU us/req",
    "proxy CPU us/req",
    "req/s",
    "failed",
]


# --- the measurement ------------------------------------------------------------------------------


@dataclass
class Target:
    """Where each variant sends: the engine, and each proxy's ``(base_url, pid)``."""

    engine_url: str
    proxies: dict[str, tuple[str, int]]
    base_model: str
    lora_name: str


async def _lora_name(gateway_url: str, base_model: str) -> str:
    """The adapter the gateway's Sessions bind to (a throwaway Session's reply header)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=f"{gateway_url}/v1", api_key=f"probe-{uuid.uuid4().hex}", max_retries=0
    ) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=base_model,
            messages=MESSAGES,
            max_tokens=1,  # type: ignore[arg-type]
        )
        return raw.headers["x-agentic-lora-name"]


def _clients(target: Target, conc: int) -> dict[str, list[Any]]:
    from openai import AsyncOpenAI

    tag = uuid.uuid4().hex[:8]

    def make(base: str, key: str) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=600.0)

    # A gateway client's key is its Session's credential: one Session per worker.
    keys = {"direct": "none", "floor": "none", "gateway": f"bench-{tag}"}
    keys["gateway_h11"] = f"bench-h11-{tag}"
    bases = {"direct": target.engine_url, **{n: u for n, (u, _) in target.proxies.items()}}
    return {
        name: [make(base, f"{keys[name]}-{w}") for w in range(conc)] for name, base in bases.items()
    }


async def _block(
    variant: str,
    clients: list[Any],
    model: str,
    per_worker: int,
    max_tokens: int,
    procs: dict[str, Any],
) -> Block:
    block = Block(variant)

    async def worker(client: Any) -> None:
        for _ in range(per_worker):
            start = time.perf_counter()
            try:
                await client.chat.completions.create(
                    model=model,
                    messages=MESSAGES,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
            except Exception as exc:
                block.failures += 1
                block.first_error = block.first_error or f"{type(exc).__name__}: {exc}"[:300]
                continue
            block.latencies.append(time.perf_counter() - start)

    before = {name: _cpu(p) for name, p in procs.items()}
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    block.wall = time.perf_counter() - t0
    block.client_cpu = time.process_time() - cpu0
    block.proxy_cpu = {name: _cpu(p) - before[name] for name, p in procs.items()}
    return block


def _cpu(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def run_level(
    target: Target, conc: int, blocks: int, per_worker: int, max_tokens: int
) -> dict[str, Any]:
    """Warm-up (binds every Session), then ``blocks`` interleaved rounds of both variants."""
    import psutil

    procs = {name: psutil.Process(pid) for name, (_, pid) in target.proxies.items()}
    clients = _clients(target, conc)
    pinned = f"{target.base_model}:{target.lora_name}"
    models = {"direct": pinned, "floor": pinned}
    models["gateway"] = models["gateway_h11"] = target.base_model
    variants = [v for v in VARIANTS if v in clients]
    try:
        for name in variants:
            await _block(name, clients[name], models[name], 2, max_tokens, procs)
        measured = [
            await _block(name, clients[name], models[name], per_worker, max_tokens, procs)
            for name in interleaved_order(variants, blocks)
        ]
    finally:
        for client in (c for group in clients.values() for c in group):
            await client.close()
    return level_report(measured)


@contextlib.asynccontextmanager
async def instant_target(
    log_level: str, http: str, profile: str | None = None, h11_gateway: bool = False
) -> AsyncIterator[Target]:
    """The instant chat engine and a gateway in front of it (with ``h11_gateway``, a second
    gateway whose uvicorn parses HTTP with h11, as the ``gateway_h11`` variant)."""
    with InstantEngine(command=[str(SERVERS), "--instant-engine"]) as engine:
        spec = {
            "engine_name": "e0",
            "engine_url": engine.base_url,
            "port": free_port(),
            "base_model": BASE_MODEL,
            "adapter": None,
            "log_level": log_level,
            "profile": profile,
            "http": http,
        }
        with contextlib.ExitStack() as stack:
            gw = stack.enter_context(proxy_process("gateway", spec))
            proxies = {
                "gateway": gw,
                "floor": stack.enter_context(proxy_process("floor", _floor(spec))),
            }
            if h11_gateway:
                h11 = {**_floor(spec), "http": "h11", "profile": None}
                proxies["gateway_h11"] = stack.enter_context(proxy_process("gateway", h11))
            lora = await _lora_name(gw[0], BASE_MODEL)
            yield Target(engine.base_url, proxies, BASE_MODEL, lora)


@contextlib.asynccontextmanager
async def sglang_target(log_level: str, http: str) -> AsyncIterator[Target]:
    """One harness SGLang engine and a gateway that published adapter A on it."""
    from agentic_lora_harness.engine_env import ensure_engine_env
    from agentic_lora_harness.engines import EngineFleet
    from agentic_lora_harness.fixture import build_fixture
    from common import engine_log_dir

    env = await asyncio.to_thread(ensure_engine_env)
    fixture = await asyncio.to_thread(build_fixture)
    async with EngineFleet(env, fixture, count=1, log_dir=engine_log_dir()) as fleet:
        name, engine_url = fleet.engines[0]
        spec = {
            "engine_name": name,
            "engine_url": engine_url,
            "port": free_port(),
            "base_model": fleet.served_model_name,
            "adapter": str(fixture.adapter("A")),
            "log_level": log_level,
            "http": http,
        }
        base = fleet.served_model_name
        with proxy_process("gateway", spec) as gw, proxy_process("floor", _floor(spec)) as fl:
            lora = await _lora_name(gw[0], base)
            yield Target(engine_url, {"gateway": gw, "floor": fl}, base, lora)


def _floor(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "port": free_port()}


async def run_engine(engine: str, a: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Every concurrency level on one engine."""
    levels: dict[int, dict[str, Any]] = {}
    async with (
        instant_target(a.log_level, a.http, a.profile_gateway, a.h11_gateway)
        if engine == "instant"
        else sglang_target(a.log_level, a.http)
    ) as target:
        for conc in a.concurrency:
            per_worker = a.requests if conc == 1 else a.requests_at_scale
            levels[conc] = await run_level(target, conc, a.blocks, per_worker, a.max_tokens)
    return levels


async def main_async(a: argparse.Namespace) -> None:
    """Run each engine, print its table and goals, write bench/out/gateway_overhead_<engine>.json."""
    engines = ["instant", "sglang"] if a.engine == "both" else [a.engine]
    for engine in engines:
        started = machine()
        levels = await run_engine(engine, a)
        started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        print(f"\n== {engine} engine ==")
        print_table(TABLE_HEADERS, level_rows(engine, levels))
        for conc, level in levels.items():
            for name in PROXIES:
                if name not in level["variants"]:
                    continue
                v = level["variants"][name]
                cpu = v["proxy_cpu"]
                print(
                    f"c={conc} {name}: p99 ratio {v['p99_ratio']:.3f}; CPU raw "
                    f"{cpu['raw_us_per_request']:.0f} us/req, idle {cpu['idle_us_per_s']:.0f} us/s"
                )
        checks = check_goals(engine, levels)
        print("goals:")
        print("\n".join(goal_lines(checks)))
        payload = {"engine": engine, "args": vars(a), "machine": started, "levels": levels}
        payload["goals"] = checks
        name = f"gateway_overhead_{engine}" + ("_profiled" if a.profile_gateway else "")
        print(f"written: {write_result(name, payload)}")


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print, write the JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", choices=["instant", "sglang", "both"], default="both")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 64])
    p.add_argument("--blocks", type=int, default=8, help="rounds per variant")
    p.add_argument("--requests", type=int, default=50, help="per block at 1 concurrent")
    p.add_argument("--requests-at-scale", type=int, default=4, help="per worker per block")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--log-level", default="INFO", help="the gateway's (default INFO, as serve)")
    p.add_argument(
        "--http",
        choices=["auto", "h11", "httptools"],
        default="auto",
        help="both proxies' HTTP parser (uvicorn's; auto: httptools when installed, else h11)",
    )
    p.add_argument(
        "--h11-gateway",
        action="store_true",
        help="instant engine: also a second gateway whose uvicorn parses HTTP with h11 "
        "(variant gateway_h11), to weigh the parser in the same interleaved run",
    )
    p.add_argument(
        "--profile-gateway",
        metavar="PATH",
        help="instant engine: profile the gateway process (pyinstrument) into PATH; its CPU "
        "figures are then the profiler's too",
    )
    a = p.parse_args(argv)
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
