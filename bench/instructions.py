"""Instructions per dispatch under callgrind: a figure load moves far less than bench/dispatch.py's times.

Each variant of :mod:`dispatch` (``aiohttp``, ``passthrough``, ``full``) runs twice under
``valgrind --tool=callgrind``, once with ``N`` and once with ``2N`` dispatches; the difference of
the two totals divided by ``N`` is the count per dispatch, so start-up, imports and warm-up cancel
out. The instant engine runs in its own process, outside valgrind: the count
is this client's own work per dispatch (Python, aiohttp and the event loop included).

Every run has the same hash seed (``PYTHONHASHSEED=0``): with a random one, string hashes and so
dictionary and set layouts differ between the N and the 2N run, which moved the differenced
count by about 10,000 instructions from one invocation to the next. The runs are independent,
so ``--jobs`` of them may run at once; one at a time is the default, since a busier machine
makes the engine's answers arrive at other moments, and how many event-loop turns a dispatch
takes, so its count, moves a little with them.

Usage: python bench/instructions.py [--variants aiohttp,passthrough,full] [--dispatches 400]
       [--jobs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
TURNS = 8


async def _child(variant: str, dispatches: int) -> None:
    sys.path.insert(0, str(HERE))
    import dispatch

    async with dispatch.instant_target() as t:
        worker = dispatch.WORKERS[variant]
        await worker(t, 4, TURNS, dispatch.Samples(), "warm")
        await worker(t, dispatches // TURNS, TURNS, dispatch.Samples(), "count")


def _instructions(out: Path) -> int:
    text = out.read_text()
    found = re.search(r"^summary:\s+(\d+)", text, re.MULTILINE) or re.search(
        r"^totals:\s+(\d+)", text, re.MULTILINE
    )
    if found is None:
        raise RuntimeError(f"no instruction total in {out}")
    return int(found.group(1))


def _total(variant: str, dispatches: int) -> int:
    """Instructions of one whole run of ``variant`` with ``dispatches`` measured dispatches."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                variant,
                "--dispatches",
                str(dispatches),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        return _instructions(out)


def counts(variants: list[str], dispatches: int, jobs: int) -> dict[str, float]:
    """Instructions per dispatch of each variant: two runs, N and 2N dispatches, differenced."""
    runs = [(v, n) for v in variants for n in (dispatches, 2 * dispatches)]
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        totals = dict(zip(runs, pool.map(lambda run: _total(*run), runs), strict=True))
    return {v: (totals[v, 2 * dispatches] - totals[v, dispatches]) / dispatches for v in variants}


def main() -> None:
    """Run each variant under callgrind and print instructions per dispatch beside aiohttp's."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="aiohttp,passthrough,full")
    p.add_argument("--dispatches", type=int, default=400)
    p.add_argument("--jobs", type=int, default=1, help="callgrind runs at once")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        asyncio.run(_child(a.child, a.dispatches))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    per_dispatch = counts([v for v in a.variants.split(",") if v], a.dispatches, a.jobs)
    base = per_dispatch.get("aiohttp")
    print(f"instructions per dispatch ({a.dispatches} dispatches, instant engine, callgrind)")
    for variant, ir in per_dispatch.items():
        extra = "" if base is None else f"  (+{ir - base:,.0f} over aiohttp, x{ir / base:.2f})"
        print(f"  {variant:12s} {ir:>12,.0f}{extra}")


if __name__ == "__main__":
    main()
