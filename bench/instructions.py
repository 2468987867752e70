"""Instructions per dispatch under callgrind: a noise-free figure beside bench/dispatch.py's times.

Each variant of :mod:`dispatch` (``aiohttp``, ``passthrough``, ``full``) runs twice under
``valgrind --tool=callgrind``, once with ``N`` and once with ``2N`` dispatches; the difference of
the two totals divided by ``N`` is the count per dispatch, so start-up, imports and warm-up cancel
out. The instant engine runs in its own process, outside valgrind: the count
is this client's own work per dispatch (Python, aiohttp and the event loop included).

Usage: python bench/instructions.py [--variants aiohttp,passthrough,full] [--dispatches 400]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
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
        )
        return _instructions(out)


def count(variant: str, dispatches: int) -> float:
    """Instructions per dispatch of ``variant``: two runs, N and 2N dispatches, differenced."""
    return (_total(variant, 2 * dispatches) - _total(variant, dispatches)) / dispatches


def main() -> None:
    """Run each variant under callgrind and print instructions per dispatch beside aiohttp's."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="aiohttp,passthrough,full")
    p.add_argument("--dispatches", type=int, default=400)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        asyncio.run(_child(a.child, a.dispatches))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    counts = {v: count(v, a.dispatches) for v in a.variants.split(",") if v}
    base = counts.get("aiohttp")
    print(f"instructions per dispatch ({a.dispatches} dispatches, instant engine, callgrind)")
    for variant, ir in counts.items():
        extra = "" if base is None else f"  (+{ir - base:,.0f} over aiohttp, x{ir / base:.2f})"
        print(f"  {variant:12s} {ir:>12,.0f}{extra}")


if __name__ == "__main__":
    main()
