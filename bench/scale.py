"""Scale in one process: thousands of concurrent Sessions on the instant engine.

Two figures, each beside its goal:

* **CPU per dispatch** with ``n`` Sessions open and taking turns (``--turns`` dispatches each,
  by 64 worker tasks, so 64 dispatches are in flight at every level), for ``n`` in ``--levels`` (64, 1,000 and 10,000 by
  default), blocks interleaved level by level so a noisy neighbour hits every level alike. Goal:
  the largest level at most 1.1x the 64-Session figure. The 1k and 10k figures side by side show
  whether anything on the dispatch path scans all Sessions (an O(n) step would grow ten-fold).
* **Memory per open Session** (``tracemalloc``): the Python memory held by ``n`` open, bound
  Sessions (the Session objects, ``Versioning``'s index and the registry's records), after each
  dispatched once and nothing is in flight, divided by ``n``. Goal: at most 2 KiB.

The instant engine (``bench/instant_engine.py``) answers at once in its own process, so the CPU
is this process's: the library plus aiohttp and the event loop.

Usage: python bench/scale.py [--levels 64,1000,10000] [--turns 4] [--blocks 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc
import uuid
from typing import Any

from common import instant_setup
from common import machine
from common import print_table
from common import write_result

from agentic_lora.session import Versioning

__all__ = ["main", "measure_cpu", "measure_memory"]

BODY: dict[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
CPU_RATIO_GOAL = 1.1
MEMORY_GOAL_BYTES = 2048
WORKERS = 64


async def _open(versioning: Versioning, n: int, tag: str) -> list[str]:
    ids = [f"{tag}-{k}-{uuid.uuid4().hex[:8]}" for k in range(n)]
    for sid in ids:
        versioning.open_session(sid)
    return ids


async def _close(versioning: Versioning, ids: list[str]) -> None:
    for sid in ids:
        await versioning.close_session(sid)


async def measure_cpu(versioning: Versioning, n: int, turns: int) -> float:
    """CPU seconds per dispatch with ``n`` Sessions dispatching at once (bind turn excluded)."""
    ids = await _open(versioning, n, f"cpu{n}")

    async def worker(mine: list[str], count: int) -> None:
        for _ in range(count):
            for sid in mine:  # this worker's Sessions, one turn each, round after round
                session = versioning.get(sid)  # the per-turn lookup a framework does
                assert session is not None
                await session.generate(BODY)

    # All n Sessions are open and take turns; at most WORKERS dispatches are in flight (the
    # connection pool's size: more would only queue for a connection, and time out waiting).
    shares = [ids[w::WORKERS] for w in range(min(n, WORKERS))]
    await asyncio.gather(*(worker(mine, 1) for mine in shares))  # bind every Session first
    cpu = time.process_time()
    await asyncio.gather(*(worker(mine, turns) for mine in shares))
    spent = time.process_time() - cpu
    await _close(versioning, ids)
    return spent / (n * turns)


async def measure_memory(versioning: Versioning, n: int) -> float:
    """Bytes of Python memory per open, bound Session (tracemalloc, nothing in flight)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ids = await _open(versioning, n, f"mem{n}")
        for sid in ids:
            session = versioning.get(sid)
            assert session is not None
            await session.generate(BODY)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before - _ids_bytes(ids)
    finally:
        tracemalloc.stop()
    await _close(versioning, ids)
    return held / n


def _ids_bytes(ids: list[str]) -> int:
    # The harness's own list of ids is not the library's memory (the ids themselves are: the
    # library keys its records by them, so they stay counted).
    import sys

    return sys.getsizeof(ids)


def _split(values: str) -> list[int]:
    return [int(v) for v in values.split(",") if v.strip()]


async def run(levels: list[int], turns: int, blocks: int) -> dict[str, Any]:
    """Interleaved CPU blocks per level, then memory per level; the figures beside the goals."""
    cpu: dict[int, list[float]] = {n: [] for n in levels}
    memory: dict[int, float] = {}
    async with instant_setup() as setup:
        versioning = Versioning(transport=setup.transport, registry=setup.registry)
        await measure_cpu(versioning, min(levels), turns)  # warm-up
        for block in range(blocks):
            order = levels if block % 2 == 0 else list(reversed(levels))
            for n in order:
                cpu[n].append(await measure_cpu(versioning, n, turns))
        for n in levels:
            memory[n] = await measure_memory(versioning, n)
        await versioning.aclose()
    per_dispatch = {n: statistics.median(v) * 1e6 for n, v in cpu.items()}
    base, top = min(levels), max(levels)
    ratio = per_dispatch[top] / per_dispatch[base]
    goals = {
        f"CPU per dispatch, {top} / {base} Sessions <= {CPU_RATIO_GOAL}": {
            "value": ratio,
            "holds": ratio <= CPU_RATIO_GOAL,
        },
        f"memory per open Session at {top} <= {MEMORY_GOAL_BYTES} B": {
            "value": memory[top],
            "holds": memory[top] <= MEMORY_GOAL_BYTES,
        },
    }
    return {"cpu_us_per_dispatch": per_dispatch, "memory_bytes_per_session": memory, "goals": goals}


async def main() -> None:
    """Parse arguments, run, print the table and the goals, write bench/out/scale.json."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--levels", type=_split, default=[64, 1000, 10000])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--blocks", type=int, default=3)
    a = p.parse_args()
    started = machine()
    report = await run(a.levels, a.turns, a.blocks)
    print_table(
        ["open Sessions", "CPU us/dispatch", "memory B/Session"],
        [
            (n, report["cpu_us_per_dispatch"][n], report["memory_bytes_per_session"][n])
            for n in a.levels
        ],
    )
    print("\ngoals:")
    for name, check in report["goals"].items():
        print(f"  {'HOLDS ' if check['holds'] else 'MISSED'}  {name}: {check['value']:.3f}")
    print(f"written: {write_result('scale', {'machine': started, **report})}")


if __name__ == "__main__":
    asyncio.run(main())
