"""Memory: RSS of the registry + middleware over 1,000,000 Session open/close cycles.

Each cycle is what one agent episode costs the product: :meth:`Versioning.open_session`, one
``/generate`` through the versioned Session (bind at the first generation, pin, guard, router,
one send) and ``close`` (``begin_close``, drain, ``release``, drop the record,
``forget_sessions``). ``--concurrency`` workers run cycles side by side, so that many Sessions
are alive at once as in a rollout worker.

The engine is a no-op: respx answers ``/generate`` inside the process (``using="httpx"``
intercepts the aiohttp transport too), so the run measures our memory, not a server's. respx
records every call it answers; that list is the harness's, so it is cleared every
``--reset-every`` cycles and before every RSS sample.

RSS is sampled (after ``gc.collect()``) every ``--sample-every`` cycles. Reported: RSS before
the first cycle, after the warm-up, at the end; growth over the whole run and after warm-up; the
live Session records left in ``Versioning`` and the registry; the object types whose counts grew
the most between warm-up and the end (empty when nothing accumulates).

Prints a summary and writes ``bench/out/memory.json``.

Usage: python bench/memory.py [--cycles 1000000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import resource
import time
from typing import Any

import respx
from common import machine
from common import print_table
from common import publish_in_registry
from common import rss_mb
from common import write_result

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.session import Versioning

__all__ = ["main", "run"]

ENGINE_URL = "http://noop-engine.invalid"
BODY: dict[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
REPLY: dict[str, Any] = {
    "text": " ok",
    "meta_info": {"id": "noop", "finish_reason": {"type": "length", "length": 1}},
}
GROWTH_TARGET_MB = 20.0


def _type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


async def run(
    cycles: int, concurrency: int, sample_every: int, warmup: int, reset_every: int
) -> dict[str, Any]:
    """Run the cycles; returns the measurements (see module docstring)."""
    registry = LocalRegistry(engines=("e0",), capacity=2)
    await publish_in_registry(registry, "e0")
    transport = EngineTransport([EngineRef("e0", ENGINE_URL)])
    versioning = Versioning(transport=transport, registry=registry)
    series: list[dict[str, float]] = []
    marks: dict[str, Any] = {}
    done = 0
    try:
        with respx.mock(using="httpx", assert_all_called=False) as mock:
            mock.post(f"{ENGINE_URL}/generate").respond(200, json=REPLY)

            def sample() -> None:
                mock.reset()
                gc.collect()
                series.append(
                    {"cycles": done, "rss_mb": rss_mb(), "seconds": time.perf_counter() - t0}
                )

            async def worker(w: int, count: int) -> None:
                nonlocal done
                for i in range(count):
                    async with versioning.session(f"m{w}-{i}") as s:
                        await s.generate(BODY)
                    done += 1
                    if done % reset_every == 0:
                        mock.reset()
                    if done % sample_every == 0:
                        sample()
                    if done == warmup:
                        if done % sample_every:
                            sample()
                        marks["types_after_warmup"] = _type_counts()

            t0 = time.perf_counter()
            sample()
            per, extra = divmod(cycles, concurrency)
            await asyncio.gather(
                *(worker(w, per + (1 if w < extra else 0)) for w in range(concurrency))
            )
            seconds = time.perf_counter() - t0
            if done % sample_every:
                sample()
            types_end = _type_counts()
    finally:
        await versioning.aclose()
        await transport.aclose()
        await registry.aclose()

    start = series[0]["rss_mb"]
    at_warmup = next((s["rss_mb"] for s in series if s["cycles"] >= warmup), start)
    end = series[-1]["rss_mb"]
    grown = types_end - marks.get("types_after_warmup", collections.Counter())
    status = await registry.status()
    return {
        "cycles": done,
        "concurrency": concurrency,
        "seconds": seconds,
        "cycles_per_s": done / seconds,
        "rss_start_mb": start,
        "rss_after_warmup_mb": at_warmup,
        "rss_end_mb": end,
        "growth_total_mb": end - start,
        "growth_after_warmup_mb": end - at_warmup,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "live_sessions_in_versioning": len(versioning.live_sessions()),
        "live_sessions_in_registry": status.live_sessions,
        "warmup_cycles": warmup,
        "object_types_grown_after_warmup": dict(grown.most_common(10)),
        "series": series,
        "target": {
            "growth_total_mb <= 20": end - start <= GROWTH_TARGET_MB,
        },
    }


async def main() -> None:
    """Parse arguments, run, print the summary, write bench/out/memory.json."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cycles", type=int, default=1_000_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-every", type=int, default=50_000)
    p.add_argument("--warmup", type=int, default=50_000)
    p.add_argument("--reset-every", type=int, default=1_000)
    a = p.parse_args()
    if a.cycles < 1 or a.concurrency < 1 or a.sample_every < 1 or a.reset_every < 1:
        p.error("--cycles, --concurrency, --sample-every and --reset-every must be positive")
    started = machine()
    result = await run(
        a.cycles, a.concurrency, a.sample_every, min(a.warmup, a.cycles), a.reset_every
    )
    result["machine"] = started
    print_table(
        ["cycles", "RSS MiB", "seconds"],
        [[int(s["cycles"]), s["rss_mb"], s["seconds"]] for s in result["series"]],
    )
    print(
        f"\n{result['cycles']:,} Session open/close cycles ({result['concurrency']} concurrent, "
        f"{result['cycles_per_s']:,.0f}/s): RSS {result['rss_start_mb']:.1f} -> "
        f"{result['rss_end_mb']:.1f} MiB, growth {result['growth_total_mb']:+.1f} MiB "
        f"({result['growth_after_warmup_mb']:+.1f} MiB after the first {result['warmup_cycles']:,}), "
        f"peak {result['peak_rss_mb']:.1f} MiB; live Sessions left: "
        f"{result['live_sessions_in_versioning']} in Versioning, "
        f"{result['live_sessions_in_registry']} in the registry"
    )
    print(
        f"object types grown after warm-up: {result['object_types_grown_after_warmup'] or 'none'}"
    )
    held = result["target"]["growth_total_mb <= 20"]
    print(f"target growth <= {GROWTH_TARGET_MB:.0f} MiB: {'HOLDS' if held else 'MISSED'}")
    print(f"written: {write_result('memory', result)}")


if __name__ == "__main__":
    asyncio.run(main())
