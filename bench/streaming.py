"""Streaming overhead: a versioned Session's stream vs a direct streamed call to the same engine.

Three ways to stream the same SGLang ``/generate`` body, run in one process, interleaved block by
block (ABBA order, so a noisy neighbour or a slow drift hits all alike):

* ``direct``: ``httpx.AsyncClient`` on ``httpx_aiohttp.AiohttpTransport`` streaming
  ``POST /generate`` with the adapter named by hand, read line by line (the baseline the targets
  are written against);
* ``aiohttp``: the same with a bare ``aiohttp.ClientSession`` (the product's own HTTP stack, with
  nothing on top: the gap from it to ``versioned`` is this library's cost alone);
* ``versioned``: :meth:`Session.stream` of a versioned Session (bind at its first turn, pin,
  dispatch guard, router; the chain in a task of its own while the reader reads the engine's
  answer inline), every chunk carrying its version.

Engines: ``sglang`` is one real SGLang engine from the test harness, adapter A published through
HTTP push; ``instant`` is ``bench/instant_engine.py`` in its own process streaming ``--tokens``
chunks at once (no generation: what is left is the client's own cost to the first chunk), with a
LocalRegistry holding one committed version.

Per stream: TTFT (from the call to the first chunk in hand) and every inter-chunk gap; TTFT is
also kept apart for the streams that are not a Session's first ("later"), since a versioned
Session's first stream carries its registry bind and an agent streams many turns per Session; and the client process's CPU time
per stream (``time.process_time`` over each block). Prints one table per concurrency and the versioned/direct ratios side by side; writes ``bench/out/streaming.json``.
Beside the pooled TTFT p50 ratio it prints a paired one: each block's own p50, divided by the
same round's block of the other variant, median over rounds (a drift or a burst that lasts a
round moves both blocks of a pair alike).

Usage: python bench/streaming.py [--engine sglang|instant] [--concurrency 1,64] [--blocks 8]
       [--streams 4] [--streams-at-scale 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import aiohttp
import httpx
from common import instant_setup
from common import interleaved_order
from common import machine
from common import median_block_ratio
from common import print_table
from common import sglang_setup
from common import summarize
from common import write_result

from agentic_lora.foundation.requests import Route
from agentic_lora.session import Versioning

US = 1e6
VARIANTS = ("direct", "aiohttp", "versioned")


@dataclass
class Target:
    url: str
    lora_name: str
    body: dict[str, Any]
    versioning: Versioning
    direct: httpx.AsyncClient
    raw: aiohttp.ClientSession


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    #: TTFT of the streams after a worker's first in its block (a Session's later turns).
    ttft_later: list[float] = field(default_factory=list)
    chunks: int = 0
    #: Client process CPU seconds spent in this variant's blocks.
    cpu: float = 0.0
    failures: list[str] = field(default_factory=list)
    #: Each block's own TTFT p50, in block order: the k-th block of every variant ran within one
    #: round of the others' k-th, so their ratio is taken under about the same load.
    block_ttft_p50: list[float] = field(default_factory=list)


async def _direct(t: Target, streams: int, out: Samples, tag: str) -> None:
    body = {**t.body, "lora_path": t.lora_name, "stream": True}
    for turn in range(streams):
        start = last = time.perf_counter()
        first = True
        async with t.direct.stream("POST", t.url + "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                json.loads(line[5:])  # the reader decodes each chunk, as Session.stream does
                now = time.perf_counter()
                _record(out, turn, first, now - (start if first else last))
                first, last = False, now


async def _aiohttp(t: Target, streams: int, out: Samples, tag: str) -> None:
    body = {**t.body, "lora_path": t.lora_name, "stream": True}
    for turn in range(streams):
        start = last = time.perf_counter()
        first = True
        async with t.raw.post(t.url + "/generate", json=body) as response:
            async for raw in response.content:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                json.loads(line[5:])
                now = time.perf_counter()
                _record(out, turn, first, now - (start if first else last))
                first, last = False, now


def _record(out: Samples, turn: int, first: bool, seconds: float) -> None:
    if first:
        out.ttft.append(seconds)
        if turn > 0:
            out.ttft_later.append(seconds)
    else:
        out.gaps.append(seconds)
    out.chunks += 1


async def _versioned(t: Target, streams: int, out: Samples, tag: str) -> None:
    session = t.versioning.open_session(f"{tag}-{uuid.uuid4().hex[:8]}")
    try:
        for turn in range(streams):
            start = last = time.perf_counter()
            first = True
            async for _chunk in session.stream(Route.GENERATE, t.body):
                now = time.perf_counter()
                _record(out, turn, first, now - (start if first else last))
                first, last = False, now
    finally:
        await session.close()


WORKERS: dict[str, Callable[[Target, int, Samples, str], Awaitable[None]]] = {
    "direct": _direct,
    "aiohttp": _aiohttp,
    "versioned": _versioned,
}


async def _block(t: Target, variant: str, concurrency: int, streams: int, out: Samples) -> None:
    async def guarded(w: int) -> None:
        try:
            await WORKERS[variant](t, streams, out, f"{variant}-w{w}")
        except Exception as exc:  # counted and reported, never hidden
            out.failures.append(f"{type(exc).__name__}: {exc}")

    cpu, seen = time.process_time(), len(out.ttft)
    await asyncio.gather(*(guarded(w) for w in range(concurrency)))
    out.cpu += time.process_time() - cpu
    if len(out.ttft) > seen:
        out.block_ttft_p50.append(summarize(out.ttft[seen:]).p50)


async def measure(t: Target, concurrency: int, blocks: int, streams: int) -> dict[str, Samples]:
    results = {v: Samples() for v in VARIANTS}
    for v in VARIANTS:
        await _block(t, v, concurrency, 1, Samples())  # warm-up
    for v in interleaved_order(VARIANTS, blocks):
        await _block(t, v, concurrency, streams, results[v])
    return results


def _report(samples: dict[str, Samples]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v, s in samples.items():
        out[v] = {
            "ttft_us": summarize(s.ttft).scaled(US).as_dict(),
            "ttft_later_us": summarize(s.ttft_later).scaled(US).as_dict() if s.ttft_later else None,
            "gap_us": summarize(s.gaps).scaled(US).as_dict(),
            "chunks": s.chunks,
            "cpu_per_stream_us": s.cpu / max(1, len(s.ttft)) * US,
            "failures": s.failures[:5],
            "failure_count": len(s.failures),
            "block_ttft_p50_us": [p50 * US for p50 in s.block_ttft_p50],
        }
    out["ratio"] = _ratios(out["versioned"], out["direct"])
    out["ratio_same_stack"] = _ratios(out["versioned"], out["aiohttp"])
    return out


def _ratios(v: dict[str, Any], d: dict[str, Any]) -> dict[str, float | None]:
    return {
        "ttft_p50": v["ttft_us"]["p50"] / d["ttft_us"]["p50"],
        "ttft_p99": v["ttft_us"]["p99"] / d["ttft_us"]["p99"],
        "ttft_p50_paired": median_block_ratio(v["block_ttft_p50_us"], d["block_ttft_p50_us"]),
        "ttft_later_p50": (
            v["ttft_later_us"]["p50"] / d["ttft_later_us"]["p50"]
            if v["ttft_later_us"] and d["ttft_later_us"]
            else None
        ),
        "gap_p50": v["gap_us"]["p50"] / d["gap_us"]["p50"],
        "gap_p99": v["gap_us"]["p99"] / d["gap_us"]["p99"],
        "cpu_per_stream": v["cpu_per_stream_us"] / d["cpu_per_stream_us"],
    }


def _body(tokens: int) -> dict[str, Any]:
    return {
        "text": "Count from one to one hundred:",
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
    }


@contextlib.asynccontextmanager
async def instant_target(tokens: int) -> AsyncIterator[Target]:
    """The instant engine in its own process, a LocalRegistry with one committed version."""
    async with instant_setup() as setup:
        versioning = Versioning(transport=setup.transport, registry=setup.registry)
        yield Target(
            str(setup.engine.base_url),
            setup.lora_name,
            _body(tokens),
            versioning,
            setup.direct,
            setup.raw,
        )


@contextlib.asynccontextmanager
async def sglang_target(tokens: int) -> AsyncIterator[Target]:
    """One real SGLang engine (harness), adapter A published through a Deployment (HTTP push)."""
    async with sglang_setup("streaming") as setup:
        yield Target(
            str(setup.engine.base_url),
            setup.lora_name,
            _body(tokens),
            setup.versioning,
            setup.direct,
            setup.raw,
        )


def _print(conc: int, report: dict[str, Any]) -> None:
    rows = []
    for v in VARIANTS:
        r = report[v]
        rows.append(
            [
                v,
                r["ttft_us"]["count"],
                f"{r['ttft_us']['p50']:.0f}",
                f"{r['ttft_us']['p99']:.0f}",
                f"{r['gap_us']['p50']:.0f}",
                f"{r['gap_us']['p99']:.0f}",
                f"{r['cpu_per_stream_us']:.0f}",
                r["failure_count"],
            ]
        )
    for key, label in (("ratio", "versioned/direct"), ("ratio_same_stack", "versioned/aiohttp")):
        ratio = report[key]
        rows.append(
            [
                label,
                "",
                f"{ratio['ttft_p50']:.3f}",
                f"{ratio['ttft_p99']:.3f}",
                f"{ratio['gap_p50']:.3f}",
                f"{ratio['gap_p99']:.3f}",
                f"{ratio['cpu_per_stream']:.3f}",
                "",
            ]
        )
    print(f"\n{conc} concurrent Sessions")
    if report["ratio"]["ttft_later_p50"] is not None:
        later = {v: report[v]["ttft_later_us"]["p50"] for v in VARIANTS}
        print(
            "later streams of a Session: TTFT p50 "
            + ", ".join(f"{v} {p50:.0f} us" for v, p50 in later.items())
            + f"; versioned/direct {report['ratio']['ttft_later_p50']:.3f}, versioned/aiohttp "
            f"{report['ratio_same_stack']['ttft_later_p50']:.3f}"
        )
    paired = [report[key]["ttft_p50_paired"] for key in ("ratio", "ratio_same_stack")]
    if all(ratio == ratio for ratio in paired):  # NaN: no block of a variant had a stream
        print(
            f"TTFT p50 ratio paired block by block (median over rounds): versioned/direct "
            f"{paired[0]:.3f}, versioned/aiohttp {paired[1]:.3f}"
        )
    print_table(
        [
            "variant",
            "streams",
            "TTFT p50 us",
            "TTFT p99 us",
            "gap p50 us",
            "gap p99 us",
            "CPU/stream us",
            "fail",
        ],
        rows,
    )


def _split(values: str) -> list[int]:
    return [int(v) for v in values.split(",") if v.strip()]


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--engine", choices=["sglang", "instant"], default="sglang")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--streams", type=int, default=4, help="streams per worker per block")
    parser.add_argument(
        "--streams-at-scale",
        type=int,
        default=2,
        help="streams per worker per block above 1 Session (>= 2 measures later turns too)",
    )
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    reports: dict[int, Any] = {}
    target_of = instant_target if args.engine == "instant" else sglang_target
    async with target_of(args.tokens) as target:
        for conc in _split(args.concurrency):
            t0 = time.perf_counter()
            streams = args.streams if conc == 1 else args.streams_at_scale
            reports[conc] = _report(await measure(target, conc, args.blocks, streams))
            reports[conc]["seconds"] = time.perf_counter() - t0
            _print(conc, reports[conc])
    path = write_result(
        "streaming" if args.engine == "sglang" else f"streaming-{args.engine}",
        {"machine": machine(), "args": vars(args), "concurrency": reports},
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
