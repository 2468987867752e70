"""Dispatch scale-out: 1, 2 and 4 client processes, each with 64 Sessions, one shared Ray registry.

Every client process is a rollout worker: its own ``Versioning`` (the product's full versioned
path) on one ``EngineTransport``, against one named Ray registry actor (in memory) that all of
them share, and one instant engine (``bench/instant_engine.py``, answers at once). Each of the 64
concurrent loops of a process runs Sessions of ``--turns`` generations back to back: open, bind
at the first generation, the turns, close (``begin_close``, ``release``, ``forget_sessions``).

The processes connect first, then start together (a line on their stdin) and run for
``--seconds``. Reported per level: aggregate dispatches/s and registry calls/s (four per Session:
``bind_first``, ``begin_close``, ``release``, ``forget_sessions``), and the CPU the clients, the
engine and the registry actor used per second of the run, to show what bounds it.

Usage: python bench/dispatch_scaleout.py [--processes 1,2,4] [--sessions 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from common import InstantEngine
from common import machine
from common import print_table
from common import write_result

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.session import Versioning
from agentic_lora.testing.publish import publish_by_verbs

__all__ = ["main"]

ACTOR = "bench-dispatch-scaleout"
NAMESPACE = "bench-dispatch-scaleout"
BODY: dict[str, Any] = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
REGISTRY_CALLS_PER_SESSION = 4


def _connect() -> Any:
    from agentic_lora.registry.ray_actor import connect

    return connect(engines=("e0",), capacity=2, name=ACTOR, namespace=NAMESPACE)


async def _worker(address: str, base_url: str, sessions: int, turns: int, seconds: float) -> None:
    import ray

    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    registry = _connect()
    await registry.refresh()
    transport = EngineTransport([EngineRef("e0", base_url)])
    versioning = Versioning(transport=transport, registry=registry)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the common start
    counts = {"dispatches": 0, "sessions": 0, "failures": 0}
    started, cpu = time.perf_counter(), time.process_time()
    stop_at = started + seconds

    async def loop(w: int) -> None:
        k = 0
        while time.perf_counter() < stop_at:
            session = versioning.open_session(f"{os.getpid()}-{w}-{k}")
            k += 1
            for _ in range(turns):
                try:
                    await session.generate(BODY)
                    counts["dispatches"] += 1
                except Exception:
                    counts["failures"] += 1
            await session.close()
            counts["sessions"] += 1

    await asyncio.gather(*(loop(w) for w in range(sessions)))
    wall = time.perf_counter() - started
    result = {**counts, "wall": wall, "cpu": time.process_time() - cpu}
    await versioning.aclose()
    await transport.aclose()
    print(json.dumps(result), flush=True)


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _level(
    processes: int, address: str, engine: InstantEngine, actor_pid: int, a: argparse.Namespace
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        address,
        engine.base_url,
        "--sessions",
        str(a.sessions),
        "--turns",
        str(a.turns),
        "--seconds",
        str(a.seconds),
    ]
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"a client process did not connect: {line!r}")
    engine_cpu, actor_cpu, wall = _cpu_seconds(engine.pid), _cpu_seconds(actor_pid), time.time()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=a.seconds * 20 + 120)
        results.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.time() - wall
    dispatches = sum(r["dispatches"] / r["wall"] for r in results)
    sessions = sum(r["sessions"] / r["wall"] for r in results)
    return {
        "processes": processes,
        "dispatches_per_s": dispatches,
        "registry_calls_per_s": sessions * REGISTRY_CALLS_PER_SESSION,
        "sessions_per_s": sessions,
        "client_cpu_per_s": sum(r["cpu"] / r["wall"] for r in results),
        "engine_cpu_per_s": (_cpu_seconds(engine.pid) - engine_cpu) / wall,
        "actor_cpu_per_s": (_cpu_seconds(actor_pid) - actor_cpu) / wall,
        "failures": sum(r["failures"] for r in results),
        "per_process": results,
    }


async def _main(a: argparse.Namespace) -> None:
    import ray

    started = machine()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    address = ray.get_runtime_context().gcs_address
    levels = []
    try:
        with InstantEngine() as engine:
            registry = _connect()
            await publish_by_verbs(
                registry, "bench", ("e0",), digest="cd" * 32, incarnation="bench"
            )
            actor_pid = ray.get(registry.actor.pid.remote())
            for n in a.processes:
                levels.append(_level(n, address, engine, actor_pid, a))
                print(f"{n} client processes done", flush=True)
            ray.kill(registry.actor, no_restart=True)
    finally:
        ray.shutdown()
    print(f"\n== scale-out: {a.sessions} Sessions per process, {a.turns} turns each ==")
    print_table(
        [
            "processes",
            "dispatches/s",
            "registry calls/s",
            "client CPU/s",
            "engine CPU/s",
            "actor CPU/s",
            "fail",
        ],
        [
            [
                r["processes"],
                r["dispatches_per_s"],
                r["registry_calls_per_s"],
                r["client_cpu_per_s"],
                r["engine_cpu_per_s"],
                r["actor_cpu_per_s"],
                r["failures"],
            ]
            for r in levels
        ],
    )
    started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"written: {write_result('dispatch_scaleout', {'machine': started, 'levels': levels})}")


def main() -> None:
    """Run the levels (or, with ``--worker``, be one client process)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--processes", default="1,2,4")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--worker", nargs=2, metavar=("RAY_ADDRESS", "ENGINE_URL"))
    a = p.parse_args()
    if a.worker:
        asyncio.run(_worker(a.worker[0], a.worker[1], a.sessions, a.turns, a.seconds))
        return
    a.processes = [int(n) for n in a.processes.split(",") if n.strip()]
    asyncio.run(_main(a))


if __name__ == "__main__":
    main()
