"""Registry throughput and memory.

Prints a table and writes bench/out/registry.json:

* Session cycles per second (bind_first + begin_close + release + forget_sessions: the four calls
  one Session costs the registry) at 1 and 256 concurrent callers, for the in-memory registry, the
  journaled one (synchronous=FULL, one transaction per call, and group commit) and the Ray actor;
* RSS of a process that ran 1,000,000 Session open/close cycles through the in-memory registry.

Usage: python bench/registry.py [--cycles N] [--memory-cycles N] [--skip-ray]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from common import rss_mb

from agentic_lora.registry import LocalRegistry
from agentic_lora.registry import RegistryAPI
from agentic_lora.testing.publish import publish_by_verbs

ENGINES = ("e0", "e1")
DIGEST = "ab" * 32


async def publish(reg: RegistryAPI) -> None:
    await publish_by_verbs(reg, "A", ENGINES, digest=DIGEST, incarnation="i")


async def cycle(reg: RegistryAPI, key: str) -> None:
    await reg.bind_first(request_id=key + "/b", session_key=key)
    await reg.begin_close(request_id=key + "/c", session_key=key)
    await reg.release(request_id=key + "/r", session_key=key)
    await reg.forget_sessions(request_id=key + "/f", session_keys=[key])


async def run_cycles(reg: RegistryAPI, total: int, concurrency: int, tag: str) -> float:
    per = total // concurrency

    async def worker(w: int) -> None:
        for i in range(per):
            await cycle(reg, f"{tag}-{w}-{i}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return per * concurrency / (time.perf_counter() - t0)


async def bench_local(cycles: int, **kw: Any) -> dict[int, float]:
    out: dict[int, float] = {}
    for conc in (1, 256):
        with tempfile.TemporaryDirectory() as d:
            journal = Path(d) / "j.sqlite" if kw.get("journal") else None
            reg = LocalRegistry(
                engines=ENGINES,
                capacity=2,
                journal_path=journal,
                group_commit=kw.get("group", False),
            )
            await publish(reg)
            n = cycles if conc > 1 or not journal else max(cycles // 10, 200)
            out[conc] = await run_cycles(reg, n, conc, f"c{conc}")
            await reg.aclose()
    return out


async def bench_ray(cycles: int) -> dict[int, float]:
    import ray

    from agentic_lora.registry.ray_actor import connect

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out: dict[int, float] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            for conc in (1, 256):
                reg = connect(
                    engines=ENGINES,
                    capacity=2,
                    journal_path=Path(d) / f"j{conc}.sqlite",
                    group_commit=True,
                    name=f"bench-{conc}",
                )
                await publish(reg)
                n = cycles if conc > 1 else max(cycles // 10, 200)
                out[conc] = await run_cycles(reg, n, conc, f"r{conc}")
                ray.kill(reg.actor, no_restart=True)
    finally:
        ray.shutdown()
    return out


async def bench_memory(cycles: int) -> dict[str, float]:
    reg = LocalRegistry(engines=ENGINES, capacity=2)
    await publish(reg)
    gc.collect()
    start = rss_mb()
    warm = 50_000
    marks: dict[str, float] = {"rss_start_mb": start}
    t0 = time.perf_counter()
    for i in range(cycles):
        await cycle(reg, f"m-{i}")
        if i + 1 == warm:
            gc.collect()
            marks["rss_after_warmup_mb"] = rss_mb()
    marks["seconds"] = time.perf_counter() - t0
    gc.collect()
    marks["rss_end_mb"] = rss_mb()
    marks["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    marks["growth_total_mb"] = marks["rss_end_mb"] - start
    marks["growth_after_warmup_mb"] = marks["rss_end_mb"] - marks.get("rss_after_warmup_mb", start)
    marks["live_session_records"] = reg.core.session_count
    marks["cycles"] = cycles
    return marks


async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cycles", type=int, default=20_000)
    p.add_argument("--memory-cycles", type=int, default=1_000_000)
    p.add_argument("--skip-ray", action="store_true")
    a = p.parse_args()

    results: dict[str, Any] = {}
    results["in_memory"] = await bench_local(a.cycles)
    results["journal_full"] = await bench_local(a.cycles // 4, journal=True)
    results["journal_group_commit"] = await bench_local(a.cycles // 2, journal=True, group=True)
    if not a.skip_ray:
        results["ray_actor_group_commit"] = await bench_ray(a.cycles // 4)
    print(
        f"{'registry':<26}{'1 caller':>16}{'256 callers':>16}   (Session cycles/s; x4 = registry calls/s)"
    )
    for name, r in results.items():
        print(f"{name:<26}{r[1]:>16,.0f}{r[256]:>16,.0f}")
    mem = await bench_memory(a.memory_cycles)
    results["memory"] = mem
    print(
        f"\nmemory after {mem['cycles']:,} Session open/close cycles: RSS {mem['rss_start_mb']:.1f} -> "
        f"{mem['rss_end_mb']:.1f} MB (growth {mem['growth_total_mb']:+.1f} MB; "
        f"{mem['growth_after_warmup_mb']:+.1f} MB after the first 50,000), peak {mem['peak_rss_mb']:.1f} MB, "
        f"{mem['live_session_records']} records left, {mem['seconds']:.1f} s"
    )
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "registry.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    asyncio.run(main())
