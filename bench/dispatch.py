"""Dispatch overhead: a versioned Session's full path vs a direct httpx call to the same engine.

Five ways to send the same ``/generate`` body, run in one process, interleaved block by block
(ABBA order, so a noisy neighbour or a slow drift hits every variant alike):

* ``direct``: ``httpx.AsyncClient`` on ``httpx_aiohttp.AiohttpTransport``,
  ``client.post(url, json=body)``; the body already names the adapter. No versioning at all: the
  baseline the targets are written against (what a caller without this library would write).
* ``aiohttp``: a bare ``aiohttp.ClientSession.post`` with the pool, keep-alive expiry and
  timeouts of the transport's default stack. The product's own HTTP stack with nothing on top:
  the gap from it to ``full`` is this library's cost alone, and is printed beside the targets.
* ``transport``: :meth:`EngineTransport.send` alone (one classified attempt, no Session).
* ``passthrough``: a Session with the feature flag off (no registry, body sent as given).
* ``full``: a versioned Session: lookup by id, bind at its first dispatch (registry
  ``bind_first``), request validation, ``lora_path`` injection, dispatch guard, router, one send.

Each concurrent worker runs Sessions of ``--turns`` dispatches; every dispatch is timed from the
Session lookup to the decoded reply (the ``first`` dispatch of a Session includes its bind).
Session open+close is timed on its own (it is not on a request's path).

Engines: ``instant`` is ``bench/instant_engine.py`` in its own process (answers at once: the
difference between variants is pure client overhead); ``sglang`` is one real SGLang engine from
the test harness with the fixture adapter A published through HTTP push (end to end).

Prints one table per engine and writes ``bench/out/dispatch_<engine>.json``.

Usage: python bench/dispatch.py [--engine instant|sglang|both] [--concurrency 1,64,256]
       [--profile]   (pyinstrument profile of the full path at concurrency 1, instant engine)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp
import httpx
from common import OUT_DIR
from common import instant_setup
from common import interleaved_order
from common import machine
from common import median_block_ratio
from common import print_table
from common import publish_in_registry
from common import sglang_setup
from common import summarize
from common import write_result

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.routing import load_router
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.foundation.requests import Route
from agentic_lora.foundation.requests import check_shape
from agentic_lora.foundation.requests import new_rid
from agentic_lora.foundation.requests import parse_request
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Versioning
from agentic_lora.session.middleware import AdapterPinMiddleware
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import DispatchGuardMiddleware
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import Middleware
from agentic_lora.session.middleware import PeekGuard
from agentic_lora.session.middleware import RoutingMiddleware
from agentic_lora.session.middleware import build_chain
from agentic_lora.session.middleware import pin_adapter

logger = logging.getLogger(__name__)

__all__ = [
    "VARIANTS",
    "Plan",
    "Target",
    "breakdown",
    "check_targets",
    "main",
    "measure",
    "run_engine",
]

VARIANTS: tuple[str, ...] = ("direct", "aiohttp", "transport", "passthrough", "full")
INSTANT_BODY: dict[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
SGLANG_BODY: dict[str, Any] = {
    "text": "The engine serves the adapter version the session was bound to",
    # ignore_eos: every request decodes exactly max_new_tokens, so variants do equal work.
    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
}
US = 1e6


@dataclass
class Target:
    """One engine set-up every variant sends to."""

    name: str
    engine: EngineRef
    lora_name: str
    body: dict[str, Any]
    versioning: Versioning
    passthrough: Versioning
    direct: httpx.AsyncClient
    raw: aiohttp.ClientSession

    @property
    def legacy_body(self) -> dict[str, Any]:
        """What a caller without versioning sends: the body with the adapter named by hand."""
        return {**self.body, "lora_path": self.lora_name}


@dataclass
class Samples:
    """Everything measured for one (engine, concurrency, variant)."""

    latencies: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # first dispatch of a Session (binds)
    later: list[float] = field(default_factory=list)
    lifecycle: list[float] = field(default_factory=list)  # Session open + close
    block_p50: list[float] = field(default_factory=list)
    block_p99: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0
    failures: list[str] = field(default_factory=list)


# --- one worker per variant -------------------------------------------------------------------


async def _timed(out: Samples, send: Callable[[], Awaitable[object]], turn: int) -> None:
    """Time one dispatch. A failure is counted (with its message) and the worker goes on, as an
    agent would with its next turn; only successful dispatches enter the latency figures."""
    start = time.perf_counter()
    try:
        await send()
    except Exception as exc:
        out.failures.append(f"{type(exc).__name__}: {exc}")
        return
    elapsed = time.perf_counter() - start
    out.latencies.append(elapsed)
    (out.first if turn == 0 else out.later).append(elapsed)


async def _without_sessions(
    out: Samples, send: Callable[[], Awaitable[object]], sessions: int, turns: int
) -> None:
    """A variant that opens no Session: ``turns`` dispatches where each Session would run."""
    for _ in range(sessions):
        for turn in range(turns):
            await _timed(out, send, turn)


async def _direct(t: Target, sessions: int, turns: int, out: Samples, tag: str) -> None:
    url = t.engine.base_url + "/generate"
    body = t.legacy_body

    async def send() -> None:
        response = await t.direct.post(url, json=body)
        response.json()
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}")

    await _without_sessions(out, send, sessions, turns)


async def _aiohttp(t: Target, sessions: int, turns: int, out: Samples, tag: str) -> None:
    url = t.engine.base_url + "/generate"
    body = t.legacy_body
    raw = t.raw

    async def send() -> None:
        async with raw.post(url, json=body) as response:
            await response.json()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")

    await _without_sessions(out, send, sessions, turns)


async def _transport(t: Target, sessions: int, turns: int, out: Samples, tag: str) -> None:
    body = t.legacy_body
    transport = t.passthrough.transport
    # The lambda hands over transport.send's own coroutine: no extra frame on the measured path.
    await _without_sessions(
        out, lambda: transport.send(t.engine.name, "/generate", body), sessions, turns
    )


async def _sessions(
    versioning: Versioning, body: dict[str, Any], sessions: int, turns: int, out: Samples, tag: str
) -> None:
    for k in range(sessions):
        session_id = f"{tag}-{k}-{uuid.uuid4().hex[:8]}"
        opened = time.perf_counter()
        versioning.open_session(session_id)
        lifecycle = time.perf_counter() - opened

        async def send(sid: str = session_id) -> None:
            # The lookup a framework does per turn is part of the measured path.
            session = versioning.get(sid)
            assert session is not None
            await session.generate(body)

        for turn in range(turns):
            await _timed(out, send, turn)
        closing = time.perf_counter()
        await versioning.close_session(session_id)
        out.lifecycle.append(lifecycle + time.perf_counter() - closing)


async def _passthrough(t: Target, sessions: int, turns: int, out: Samples, tag: str) -> None:
    await _sessions(t.passthrough, t.legacy_body, sessions, turns, out, tag)


async def _full(t: Target, sessions: int, turns: int, out: Samples, tag: str) -> None:
    await _sessions(t.versioning, t.body, sessions, turns, out, tag)


Worker = Callable[[Target, int, int, Samples, str], Awaitable[None]]
WORKERS: dict[str, Worker] = {
    "direct": _direct,
    "transport": _transport,
    "passthrough": _passthrough,
    "full": _full,
    "aiohttp": _aiohttp,
}


async def _block(
    t: Target, variant: str, concurrency: int, sessions: int, turns: int, out: Samples, tag: str
) -> None:
    """All ``concurrency`` workers run ``variant`` at once; nothing else runs meanwhile."""
    block = Samples()
    worker = WORKERS[variant]

    async def guarded(w: int) -> None:
        try:
            await worker(t, sessions, turns, block, f"{tag}-w{w}")
        except Exception as exc:  # counted and reported, never hidden
            block.failures.append(f"{type(exc).__name__}: {exc}")

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(guarded(w) for w in range(concurrency)))
    out.wall += time.perf_counter() - wall
    out.cpu += time.process_time() - cpu
    out.latencies += block.latencies
    out.first += block.first
    out.later += block.later
    out.lifecycle += block.lifecycle
    out.failures += block.failures
    summary = summarize(block.latencies)
    out.block_p50.append(summary.p50)
    out.block_p99.append(summary.p99)


async def measure(
    t: Target,
    concurrency: int,
    variants: Sequence[str],
    *,
    blocks: int,
    sessions: int,
    turns: int,
) -> dict[str, Samples]:
    """Warm up one round, then ``blocks`` interleaved rounds of every variant."""
    results = {v: Samples() for v in variants}
    for v in variants:
        await _block(t, v, concurrency, 1, turns, Samples(), f"warm-{v}")
    for n, v in enumerate(interleaved_order(variants, blocks)):
        await _block(t, v, concurrency, sessions, turns, results[v], f"c{concurrency}-b{n}-{v}")
    return results


# --- reporting ---------------------------------------------------------------------------------


def _report(samples: dict[str, Samples]) -> dict[str, Any]:
    direct = samples["direct"]
    d = summarize(direct.latencies).scaled(US)
    d_first = summarize(direct.first).scaled(US)
    d_later = summarize(direct.later).scaled(US)
    d_cpu = direct.cpu / max(len(direct.latencies), 1) * US
    out: dict[str, Any] = {}
    for variant, s in samples.items():
        lat = summarize(s.latencies).scaled(US)
        first = summarize(s.first).scaled(US)
        later = summarize(s.later).scaled(US)
        cpu_us = s.cpu / max(len(s.latencies), 1) * US
        out[variant] = {
            "dispatches": len(s.latencies),
            "latency_us": lat.as_dict(),
            "first_dispatch_us": first.as_dict(),
            "later_dispatch_us": later.as_dict(),
            "session_open_close_us": (
                summarize(s.lifecycle).scaled(US).as_dict() if s.lifecycle else None
            ),
            "throughput_per_s": len(s.latencies) / s.wall if s.wall else float("nan"),
            "client_cpu_us_per_dispatch": cpu_us,
            "added_p50_us": lat.p50 - d.p50,
            "added_p99_us": lat.p99 - d.p99,
            "added_cpu_us_per_dispatch": cpu_us - d_cpu,
            "ratio_of_medians": lat.p50 / d.p50 if d.p50 else float("nan"),
            "ratio_of_means": lat.mean / d.mean if d.mean else float("nan"),
            # A Session's first dispatch (binds) and its later ones, each against the same turn
            # of the direct variant: a burst of first dispatches and the trickle after it are two
            # modes, and a pooled median can fall on either.
            "first_ratio_of_medians": first.p50 / d_first.p50 if d_first.p50 else float("nan"),
            "later_ratio_of_medians": later.p50 / d_later.p50 if d_later.p50 else float("nan"),
            "added_later_p50_us": later.p50 - d_later.p50,
            "added_later_p99_us": later.p99 - d_later.p99,
            "median_block_ratio": median_block_ratio(s.block_p50, direct.block_p50),
            # Each block's own p99, then the median over blocks: one stalled block (a
            # neighbour's burst on a shared machine) moves the pooled p99, not this.
            "median_block_p99_us": summarize(s.block_p99).p50 * US,
            "added_median_block_p99_us": (
                summarize(s.block_p99).p50 - summarize(direct.block_p99).p50
            )
            * US,
            "failures": len(s.failures),
            "failure_examples": s.failures[:3],
        }
    return out


def _print(engine: str, report: dict[int, dict[str, Any]]) -> None:
    print(f"\n== {engine}: latency per dispatch (us), interleaved in one run ==")
    rows = []
    for conc, level in report.items():
        for v, r in level["variants"].items():
            lat = r["latency_us"]
            rows.append(
                [
                    f"{conc} x {v}",
                    lat["p50"],
                    lat["p99"],
                    r["added_p50_us"],
                    r["added_p99_us"],
                    r["ratio_of_medians"],
                    r["first_ratio_of_medians"],
                    r["later_ratio_of_medians"],
                    r["client_cpu_us_per_dispatch"],
                    r["throughput_per_s"],
                    r["failures"],
                ]
            )
    print_table(
        [
            "sessions x variant",
            "p50",
            "p99",
            "+p50",
            "+p99",
            "p50 ratio",
            "1st",
            "later",
            "cpu/dispatch",
            "req/s",
            "fail",
        ],
        rows,
    )


def check_targets(report: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """The goals (issues 14 and 27): held or missed, each figure beside its goal."""
    checks: dict[str, Any] = {}

    def check(name: str, value: float, holds: bool) -> None:
        checks[name] = {"value": value, "holds": holds}

    for conc, level in report.get("instant", {}).items():
        variants = level["variants"]
        full = variants["full"]
        if conc == 1:
            added_cpu = full["added_cpu_us_per_dispatch"]
            check("instant c=1: added client CPU per dispatch <= 60 us", added_cpu, added_cpu <= 60)
            check(
                "instant c=1: added p50 <= 60 us", full["added_p50_us"], full["added_p50_us"] <= 60
            )
            lifecycle = full["session_open_close_us"]
            if lifecycle is not None:
                p50 = lifecycle["p50"]
                check("instant c=1: Session open + close p50 <= 80 us", p50, p50 <= 80)
        else:
            ratio = full["throughput_per_s"] / variants["direct"]["throughput_per_s"]
            check(f"instant c={conc}: throughput full/direct >= 0.90", ratio, ratio >= 0.90)
        raw = variants.get("aiohttp")
        if raw is not None:
            # Against the product's own HTTP stack: the library's cost alone (issue 27's goals).
            cpu = raw["client_cpu_us_per_dispatch"]
            if conc == 1:
                added = full["client_cpu_us_per_dispatch"] - cpu
                check(
                    "instant c=1: full, added client CPU over aiohttp <= 25 us", added, added <= 25
                )
                p50 = full["latency_us"]["p50"] - raw["latency_us"]["p50"]
                checks["instant c=1: full, added p50 over aiohttp (reported)"] = {
                    "value": p50,
                    "holds": True,
                }
                passthrough = variants.get("passthrough")
                if passthrough is not None:
                    over = passthrough["client_cpu_us_per_dispatch"] - cpu
                    check("instant c=1: pass-through, CPU over aiohttp <= 10 us", over, over <= 10)
            else:
                ratio = full["throughput_per_s"] / raw["throughput_per_s"]
                check(
                    f"instant c={conc}: throughput full/aiohttp >= 0.95",
                    ratio,
                    ratio >= 0.95,
                )
    for conc, level in report.get("sglang", {}).items():
        variants = level["variants"]
        ratio = variants["full"]["ratio_of_medians"]
        check(f"sglang c={conc}: full/direct p50 ratio <= 1.02", ratio, ratio <= 1.02)
        if "aiohttp" in variants:
            same = variants["full"]["latency_us"]["p50"] / variants["aiohttp"]["latency_us"]["p50"]
            check(
                f"sglang c={conc}, same stack: full/aiohttp p50 ratio <= 1.02", same, same <= 1.02
            )
    return checks


# --- where our time goes ------------------------------------------------------------------------


class _ShortCircuit:
    """A framework middleware that answers at once: the Session's own cost, without the chain."""

    def __init__(self, next_dispatch: Dispatch) -> None:
        self._next = next_dispatch

    async def __call__(self, call: EngineCall) -> EngineReply:
        return EngineReply(engine="e0", path=call.route.value, status_code=200, body=None)


async def _null_endpoint(call: EngineCall) -> EngineReply:
    return EngineReply(engine=call.engine or "-", path=call.route.value, status_code=200, body=None)


async def _per_call_us(fn: Callable[[], Awaitable[object]], n: int) -> float:
    await fn()
    start = time.perf_counter()
    for _ in range(n):
        await fn()
    return (time.perf_counter() - start) / n * US


def _per_call_sync_us(fn: Callable[[], object], n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * US


async def breakdown(n: int = 20_000) -> dict[str, float]:
    """Microseconds per dispatch of each step of ours, timed in isolation without HTTP.

    The steps are the product's own objects (Session, middlewares, router, registry peek). The
    ``*_not_done`` lines are what the path used to do instead (full pydantic validation, a
    ``uuid4`` request id), for comparison.
    """
    registry = LocalRegistry(engines=("e0",), capacity=2)
    lora_name = await publish_in_registry(registry, "e0")
    transport = EngineTransport([EngineRef("e0", "http://127.0.0.1:9")])
    try:
        short = Versioning(
            transport=transport, registry=registry, middleware=[Middleware(_ShortCircuit)]
        )
        session = short.open_session("breakdown")
        binding = await registry.bind_first(request_id=new_request_id(), session_key="bd")
        body = INSTANT_BODY
        pinned = {**body, "lora_path": lora_name, "rid": uuid.uuid4().hex}
        router = load_router("session-affinity")
        health = EngineHealth(["e0"])
        guard = PeekGuard(registry.peek_version)
        call = EngineCall(Route.GENERATE, body, session_key="bd", binding=binding)
        chain = build_chain(
            _null_endpoint,
            [
                Middleware(AdapterPinMiddleware, base_model=None),
                Middleware(DispatchGuardMiddleware, guard=guard),
                Middleware(RoutingMiddleware, router=router, health=health),
            ],
        )

        out = {
            "session_dispatch_without_chain": await _per_call_us(lambda: session.generate(body), n),
            "shape_check": _per_call_sync_us(lambda: check_shape(Route.GENERATE, body), n),
            "full_validation_not_done_pydantic": _per_call_sync_us(
                lambda: parse_request(Route.GENERATE, body), n
            ),
            "rid_counter": _per_call_sync_us(new_rid, n),
            "rid_uuid4_not_done": _per_call_sync_us(lambda: uuid.uuid4().hex, n),
            "chain_pin_guard_route": await _per_call_us(lambda: chain(call), n),
            "pin_adapter": _per_call_sync_us(
                lambda: pin_adapter(Route.GENERATE, body, lora_name, None), n
            ),
            "guard_check": _per_call_sync_us(lambda: guard.check(binding), n),
            "router_choose": _per_call_sync_us(
                lambda: router.choose("bd", health.healthy(), MappingProxyType(pinned)), n
            ),
            "call_copy": _per_call_sync_us(lambda: call.routed_to("e0"), n),
            "json_encode_body": _per_call_sync_us(
                lambda: json.dumps(pinned, separators=(",", ":")).encode(), n
            ),
        }
        await short.close_session("breakdown")
        return out
    finally:
        await transport.aclose()
        await registry.aclose()


# --- engine set-ups ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def instant_target() -> AsyncIterator[Target]:
    """The instant engine in its own process, a LocalRegistry with one committed version."""
    async with instant_setup() as setup:
        yield Target(
            name="instant",
            engine=setup.engine,
            lora_name=setup.lora_name,
            body=INSTANT_BODY,
            versioning=Versioning(transport=setup.transport, registry=setup.registry),
            passthrough=Versioning(transport=setup.transport, enabled=False),
            direct=setup.direct,
            raw=setup.raw,
        )


@contextlib.asynccontextmanager
async def sglang_target() -> AsyncIterator[Target]:
    """One real SGLang engine (harness), adapter A published through a Deployment (HTTP push)."""
    async with sglang_setup("dispatch") as setup:
        yield Target(
            name="sglang",
            engine=setup.engine,
            lora_name=setup.lora_name,
            body=SGLANG_BODY,
            versioning=setup.versioning,
            passthrough=Versioning(transport=setup.versioning.transport, enabled=False),
            direct=setup.direct,
            raw=setup.raw,
        )


# --- main ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How much to run at one concurrency: blocks per variant, Sessions per worker, turns each."""

    blocks: int
    sessions: int
    turns: int


INSTANT_PLANS = {1: Plan(12, 25, 8), 64: Plan(12, 2, 8), 256: Plan(12, 1, 8)}
SGLANG_PLANS = {1: Plan(12, 4, 4), 64: Plan(12, 1, 4), 256: Plan(10, 1, 4)}


async def run_engine(
    target: Target,
    concurrency: Sequence[int],
    variants: Sequence[str],
    plans: dict[int, Plan],
) -> dict[int, dict[str, Any]]:
    """Every concurrency level against ``target``; returns the per-variant reports."""
    report: dict[int, dict[str, Any]] = {}
    for conc in concurrency:
        plan = plans.get(conc) or Plan(8, 1, 4)
        t0 = time.perf_counter()
        samples = await measure(
            target, conc, variants, blocks=plan.blocks, sessions=plan.sessions, turns=plan.turns
        )
        report[conc] = {
            "plan": {**plan.__dict__, "seconds": time.perf_counter() - t0},
            "variants": _report(samples),
        }
        print(f"{target.name}: {conc} concurrent Sessions done in {time.perf_counter() - t0:.1f} s")
    return report


async def profile_full_path(dispatches: int = 8_000) -> Path:
    """pyinstrument profile of the versioned path at concurrency 1 against the instant engine."""
    from pyinstrument import Profiler

    async with instant_target() as t:
        await measure(t, 1, ["full"], blocks=1, sessions=10, turns=8)
        profiler = Profiler(interval=0.0005, async_mode="enabled")
        profiler.start()
        out = Samples()
        await _full(t, dispatches // 8, 8, out, "profile")
        profiler.stop()
    OUT_DIR.mkdir(exist_ok=True)
    text = OUT_DIR / "dispatch_profile.txt"
    text.write_text(profiler.output_text(unicode=False, color=False, show_all=False))
    (OUT_DIR / "dispatch_profile.html").write_text(profiler.output_html())
    print(f"profile of {len(out.latencies)} dispatches written to {text}")
    return text


def _split(values: str) -> list[int]:
    return [int(v) for v in values.split(",") if v.strip()]


async def main() -> None:
    """Parse arguments, run the chosen engines, print tables, write bench/out/dispatch.json."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", choices=["instant", "sglang", "both"], default="both")
    p.add_argument("--concurrency", type=_split, default=[1, 64, 256])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--sglang-variants", default="direct,aiohttp,full")
    p.add_argument("--blocks", type=int, help="override the blocks per variant of every level")
    p.add_argument("--profile", action="store_true", help="profile the full path and exit")
    a = p.parse_args()
    if a.profile:
        await profile_full_path()
        return

    def plans(base: dict[int, Plan]) -> dict[int, Plan]:
        if a.blocks is None:
            return base
        return {c: Plan(a.blocks, pl.sessions, pl.turns) for c, pl in base.items()}

    engines = ["instant", "sglang"] if a.engine == "both" else [a.engine]
    for engine in engines:
        started = machine()
        costs: dict[str, float] | None = None
        if engine == "instant":
            variants = [v for v in a.variants.split(",") if v]
            async with instant_target() as t:
                report = await run_engine(t, a.concurrency, variants, plans(INSTANT_PLANS))
            _print("instant engine (pure overhead)", report)
            costs = await breakdown()
            print("\nour steps, timed in isolation (us per dispatch):")
            print_table(["step", "us"], list(costs.items()))
        else:
            variants = [v for v in a.sglang_variants.split(",") if v]
            async with sglang_target() as t:
                report = await run_engine(t, a.concurrency, variants, plans(SGLANG_PLANS))
            _print("real SGLang (end to end)", report)
        started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        targets = check_targets({engine: report})
        print("\ntargets:")
        for name, check in targets.items():
            print(f"  {'HOLDS ' if check['holds'] else 'MISSED'}  {name}: {check['value']:.3f}")
        payload = {"engine": engine, "machine": started, "report": report, "targets": targets}
        if costs is not None:
            payload["breakdown_us"] = costs
        print(f"written: {write_result(f'dispatch_{engine}', payload)}")


if __name__ == "__main__":
    asyncio.run(main())
