"""Publication latency: ``publish()`` wall time against the engines' own adapter load, one run.

On ``--engines`` real SGLang engines from the test harness (the fleet of the other benchmarks),
``--rounds`` rounds, each with two steps in ABBA order (publish first in even rounds, the direct
load first in odd ones), cycling through the fixture's adapters A, B, C:

* ``publish``: :meth:`Deployment.publish` of the round's adapter under a fresh version id (HTTP
  push), timed from the call to its return. The version it retires is then reclaimed (not timed)
  before the next step, so no step shares the engines with another.
* ``direct``: the same adapter, copied to a directory of its own (not timed), loaded on every
  engine at once under another name by SGLang's own ``POST /load_lora_adapter`` (pinned, as the
  product loads), timed from the first call to the last answer; then unloaded (not timed).

Goal: publish p50 / direct p50 at most 1.15 (pooled medians; the paired ratio, each round's
publish over the same round's direct load, median over rounds, is printed beside it).

The breakdown of ``publish()`` comes from the :class:`PublicationResult`'s own per-engine,
per-phase timings (reserve, prepare, record_ready, observe incarnation, commit);
the prepare phase is split further by timing the HTTP push backend's steps from a subclass:
the store write (the snapshot's files into the engine's store directory), the engine's load
(``/load_lora_adapter``), the one-token probe, and the engine read before the load (the
adapter listing, plus ``/server_info`` when the listing cannot witness a restart: the rest of
the phase). HTTP push has no transfer of
its own: the engine reads the store directory inside its load. Per-engine phases run on all
engines at once; the slowest engine's figure is shown. A bootstrap publication and one direct
load run first, unmeasured.

Real engines: run under ``flock /tmp/agentic-lora-engines.lock``.

Usage: python bench/publication_latency.py [--engines 1] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from agentic_lora_http.backend import HttpPushBackend
from common import engine_log_dir
from common import fleet_settings
from common import machine
from common import print_table
from common import summarize
from common import write_result

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseTiming
from agentic_lora.registry.types import VersionState

__all__ = [
    "RATIO_GOAL",
    "TimedBackend",
    "breakdown",
    "check_goal",
    "main",
    "paired_ratio",
    "step_order",
]

RATIO_GOAL = 1.15
LETTERS = ("A", "B", "C")
#: The breakdown's rows, in the order a publication runs them.
ROWS = (
    ("reserve", "registry: reserve (capacity admitted)"),
    ("observe", "engine: read again after a READY refused for a restart"),
    ("store_write", "prepare: store write"),
    (
        "engine_reads",
        "prepare: engine read before the load (adapter list; /server_info too if needed)",
    ),
    ("engine_load", "prepare: engine load (/load_lora_adapter)"),
    ("probe", "prepare: one-token probe"),
    ("record_ready", "registry: record_ready"),
    ("observe_again", "engine: observe incarnation again, before commit"),
    ("commit", "registry: commit"),
    ("other", "rest (status read, lock, scheduling)"),
)


# --- pure figures (tested in tests/bench/test_publication_latency.py) ---------------------------


def step_order(round_: int) -> tuple[str, str]:
    """ABBA: publish first in even rounds, the direct load first in odd ones."""
    return ("publish", "direct") if round_ % 2 == 0 else ("direct", "publish")


def paired_ratio(publish: Sequence[float], direct: Sequence[float]) -> float:
    """Median over rounds of publish / direct (pairs with a zero direct time left out)."""
    return summarize(p / d for p, d in zip(publish, direct, strict=True) if d > 0).p50


def breakdown(
    timings: Sequence[PhaseTiming], parts: dict[str, dict[str, float]], wall: float
) -> dict[str, float]:
    """One publication's seconds per :data:`ROWS` key.

    ``timings`` are the result's phase timings; ``parts`` the backend's prepare steps per engine
    (``store_write``, ``engine_load``, ``probe``). Per-engine figures take the slowest engine.
    An engine's last OBSERVE is the one before commit; any before it followed a refused READY.
    """
    per_engine: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    fleet: dict[str, float] = defaultdict(float)
    observes: dict[str, list[float]] = defaultdict(list)
    for t in timings:
        if t.engine is None:
            fleet[t.phase.value] += t.seconds
        elif t.phase is Phase.OBSERVE:
            observes[t.engine].append(t.seconds)
        else:
            per_engine[t.engine][t.phase.value] += t.seconds
    for engine, seconds in observes.items():
        # The last is the read right before commit; any before it re-read after a refused READY.
        per_engine[engine]["observe_again"] += seconds[-1]
        per_engine[engine]["observe"] += sum(seconds[:-1])
    for engine, steps in parts.items():
        mine = per_engine[engine]
        for key, seconds in steps.items():
            mine[key] += seconds
        mine["engine_reads"] = max(0.0, mine["prepare"] - sum(steps.values()))

    def slowest(key: str) -> float:
        return max((steps.get(key, 0.0) for steps in per_engine.values()), default=0.0)

    out = {key: slowest(key) for key, _ in ROWS if key not in ("reserve", "commit", "other")}
    out["reserve"] = fleet[Phase.RESERVE.value]
    out["commit"] = fleet[Phase.COMMIT.value]
    # The engines' paths run side by side: the slowest engine's sum is what publish() waited for.
    paths = [
        s.get("observe", 0.0) + s.get("prepare", 0.0) + s.get("record_ready", 0.0)
        for s in per_engine.values()
    ]
    accounted = out["reserve"] + max(paths, default=0.0) + out["observe_again"] + out["commit"]
    out["other"] = max(0.0, wall - accounted)
    return out


def check_goal(publish: Sequence[float], direct: Sequence[float]) -> dict[str, Any]:
    """The pooled p50 ratio beside its goal, and the paired ratio beside it."""
    ratio = summarize(publish).p50 / summarize(direct).p50
    return {
        "name": f"publish p50 / direct load p50 <= {RATIO_GOAL}",
        "value": ratio,
        "paired": paired_ratio(publish, direct),
        "goal": RATIO_GOAL,
        "holds": ratio <= RATIO_GOAL,
    }


# --- the backend, timed step by step -------------------------------------------------------------


class TimedBackend(HttpPushBackend):
    """The HTTP push backend, with its prepare steps timed per engine into :attr:`parts`."""

    def __init__(self, store_root: str | os.PathLike[str]) -> None:
        super().__init__(store_root)
        self.parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def _add(self, engine: EngineRef, key: str, start: float) -> None:
        self.parts[engine.name][key] += time.perf_counter() - start

    async def _store_snapshot(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> Path:
        start = time.perf_counter()
        try:
            return await super()._store_snapshot(engine, target, snapshot)
        finally:
            self._add(engine, "store_write", start)

    async def _load(
        self, engine: EngineRef, admin: EngineAdminClient, target: PublicationTarget, path: Path
    ) -> None:
        start = time.perf_counter()
        try:
            await super()._load(engine, admin, target, path)
        finally:
            self._add(engine, "engine_load", start)

    async def _probe(self, admin: EngineAdminClient, lora_name: str) -> None:
        start = time.perf_counter()
        try:
            await super()._probe(admin, lora_name)
        finally:
            engine = next(n for n, a in self._admins.items() if a is admin)
            self.parts[engine]["probe"] += time.perf_counter() - start

    def take(self) -> dict[str, dict[str, float]]:
        """The parts recorded since the last call."""
        parts = {engine: dict(steps) for engine, steps in self.parts.items()}
        self.parts.clear()
        return parts


# --- the run -------------------------------------------------------------------------------------


async def wait_reclaimed(deployment: Deployment, version_id: str, limit: float = 120.0) -> None:
    """Poll (50 ms) until ``version_id`` is RECLAIMED; an error after ``limit`` seconds."""
    deadline = time.perf_counter() + limit
    while (await deployment.registry.version(version_id)).state is not VersionState.RECLAIMED:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{version_id} not reclaimed within {limit} s")
        await asyncio.sleep(0.05)


async def direct_load(
    http: httpx.AsyncClient, engines: Sequence[str], source: Path, name: str, scratch: Path
) -> float:
    """Seconds for every engine to load a copy of ``source`` as ``name`` (all at once)."""
    path = scratch / name
    await asyncio.to_thread(shutil.copytree, source, path)

    async def one(url: str, route: str, body: dict[str, Any]) -> None:
        answer = await http.post(f"{url}{route}", json=body)
        answer.raise_for_status()
        if route == "/load_lora_adapter" and answer.json().get("success") is not True:
            raise RuntimeError(f"direct load refused: {answer.text[:300]}")

    load = {"lora_name": name, "lora_path": str(path), "pinned": True}
    start = time.perf_counter()
    await asyncio.gather(*(one(url, "/load_lora_adapter", load) for url in engines))
    seconds = time.perf_counter() - start
    unload = {"lora_name": name}
    await asyncio.gather(*(one(url, "/unload_lora_adapter", unload) for url in engines))
    await asyncio.to_thread(shutil.rmtree, path)
    return seconds


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    """Start the fleet, bootstrap, then ``a.rounds`` interleaved rounds; the figures."""
    from agentic_lora_harness.engine_env import ensure_engine_env
    from agentic_lora_harness.engines import EngineFleet
    from agentic_lora_harness.fixture import build_fixture

    started = machine()
    env = await asyncio.to_thread(ensure_engine_env)
    fixture = await asyncio.to_thread(build_fixture)
    snapshots = {x: AdapterSnapshot.from_peft_dir(fixture.adapter(x)) for x in LETTERS}
    tag = uuid.uuid4().hex[:6]
    publish_s: list[float] = []
    direct_s: list[float] = []
    rows: list[dict[str, float]] = []
    async with EngineFleet(env, fixture, count=a.engines, log_dir=engine_log_dir()) as fleet:
        urls = [url for _, url in fleet.engines]
        with (
            tempfile.TemporaryDirectory(prefix="bench-publication-latency-") as store,
            tempfile.TemporaryDirectory(prefix="bench-direct-load-") as scratch,
        ):
            backend = TimedBackend(store)
            deployment = Deployment.from_settings(fleet_settings(fleet), backend=backend)
            async with deployment, httpx.AsyncClient(timeout=600.0, trust_env=False) as http:
                current = f"boot-{tag}"
                if not (await deployment.publish(current, snapshots["A"])).ok:
                    raise RuntimeError("bootstrap publication failed")
                await direct_load(http, urls, fixture.adapter("A"), f"warm-{tag}", Path(scratch))
                backend.take()
                for k in range(a.rounds):
                    letter = LETTERS[(k + 1) % len(LETTERS)]
                    for step in step_order(k):
                        if step == "direct":
                            source, name = fixture.adapter(letter), f"direct-{k}-{tag}"
                            direct_s.append(
                                await direct_load(http, urls, source, name, Path(scratch))
                            )
                            continue
                        version = f"{letter}{k}-{tag}"
                        t0 = time.perf_counter()
                        result = await deployment.publish(version, snapshots[letter])
                        wall = time.perf_counter() - t0
                        if not result.ok:
                            raise RuntimeError(f"publication {version} failed: {result.reason}")
                        publish_s.append(wall)
                        rows.append(
                            {"wall": wall, **breakdown(result.timings, backend.take(), wall)}
                        )
                        await wait_reclaimed(deployment, current)
                        current = version
                    print(f"round {k}: publish {publish_s[-1]:.3f} s, direct {direct_s[-1]:.3f} s")
            await backend.aclose()
    started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "machine": started,
        "settings": {"engines": a.engines, "rounds": a.rounds},
        "publish_s": publish_s,
        "direct_s": direct_s,
        "breakdown": rows,
        "goal": check_goal(publish_s, direct_s),
    }


def breakdown_rows(rows: Sequence[dict[str, float]]) -> list[list[object]]:
    """Median and range (ms) per breakdown row, then the publish total."""
    out: list[list[object]] = []
    for key, label in (*ROWS, ("wall", "publish() total")):
        values = [r[key] * 1e3 for r in rows]
        s = summarize(values)
        out.append([label, s.p50, min(values, default=float("nan")), s.maximum])
    return out


def report(result: dict[str, Any]) -> None:
    """The two sides, the breakdown and the goal."""
    p, d = summarize(result["publish_s"]).scaled(1e3), summarize(result["direct_s"]).scaled(1e3)
    print_table(
        ["step", "count", "p50 ms", "p95 ms", "max ms"],
        [
            ["publish()", p.count, p.p50, p.p95, p.maximum],
            ["direct /load_lora_adapter", d.count, d.p50, d.p95, d.maximum],
        ],
    )
    print("\nbreakdown of publish() (slowest engine per per-engine step; ms):")
    print_table(["step", "p50", "min", "max"], breakdown_rows(result["breakdown"]))
    print("transfer: none of its own (HTTP push: the engine reads the store inside its load)")
    g = result["goal"]
    print("\ngoal:")
    print(f"  {'HOLDS ' if g['holds'] else 'MISSED'}  {g['name']}: {g['value']:.3f}")
    print(f"  (paired, median over rounds: {g['paired']:.3f})")


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print, write bench/out/publication_latency.json."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args(argv)
    if a.engines < 1 or a.rounds < 1:
        p.error("--engines and --rounds must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = asyncio.run(main_async(a))
    report(result)
    print(f"\nwritten: {write_result('publication_latency', result)}")


if __name__ == "__main__":
    main()
