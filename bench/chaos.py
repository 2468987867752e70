"""Recovery per fault kind: how long after a kill -9 the fleet publishes and serves again.

Runs the chaos suite's scenarios (``tests/chaos/scenarios.py``: the same topologies, agents,
publication loop and invariant checks as the chaos tests) on two real SGLang engines started for
this run, ``--repeat`` times per fault kind, and measures on one monotonic clock:

* **back**: from the fault until the killed part runs again (engine healthy, ``serve`` serving,
  registry actor restarted by Ray; for a rollout worker, from its second kill to its restart);
* **first publication**: from the fault to the end of the first publication that committed after
  it (publications are tried every 3 s, and 1 s after one that did not commit);
* **first affected generation**: from the fault to the end of the first successful generation of
  a Session the fault affected (engine: Sessions the killed engine had served and still open;
  gateway / registry host: Sessions open at the kill; registry actor: any worker Session; rollout
  worker: from the restart, the restarted worker's first);
* rollout worker only: **refs released** (its lease expired, TTL 5 s), **slots back** (no version
  it pinned still holds a slot for it) and **restart releases** (a restarted worker ends its
  predecessor's two-minute lease).

Every run's invariant violations are counted too (``problems``; the chaos tests fail on any).

Goals (issue 10): engine restart: affected Sessions served again within the engine's start time
+ 5 s, with 0 failed requests for Sessions whose version another engine holds; worker crash:
slots back within TTL + 5 s, or within 5 s of the owner's restart. Two readings are made precise
here. "0 failed requests" counts requests started once the dead engine was out of routing: those
sent to it in the fraction of a second before the product noticed fail as the kill left them
(refused, or indeterminate when in flight), since a generation is sent exactly once and never moved
to another engine behind the caller's back; the table counts them apart. "The owner's restart" is
the moment the restarted worker opens its new lease (its process start, interpreter and Ray
included, is printed too).

Six more kinds are not kills (issue 25), and report their own figures:

* **rollback**: a rollback in the middle of agent load (``tests/chaos/rollback_scenario.py``),
  first to a RETIRED version, then to a RECLAIMED one: the trainer-visible time of each
  rollback call (``rollback_retired_s``, ``rollback_reclaimed_s``) and the failed requests (the
  goal is none);
* **disk-full**: the journal's filesystem fills up under load (``tests/chaos/full_disk.py``; no
  engines): from full to the registry's fail-stop, the requests it refused meanwhile, and back to
  normal once space is freed (reopen and replay, then a publication and a Session served);
* **reopen**: a dead worker's journal reopened by a process that opens no Session
  (``tests/leases/dead_worker.py``; no engines): when its refs were released (goal: within
  TTL + sweep interval + 5 s of the reopen) and when the next publication committed;
* **hung-engine**: one engine stopped (SIGSTOP) during dispatch, then a publication
  (``tests/chaos/hung_engine.py``, at the documented probe and ejection defaults): the
  trainer-visible publication time (goal: under 30 s), the ejection time, the failed requests
  (in flight at the stop, sent after it) and, after SIGCONT, the time back to normal;
* **engine-add**, **engine-drain**: an engine joins, or one drains, under agent load with a
  publication during the change (``tests/chaos/membership_load.py``): back to normal (ACTIVE and
  serving; REMOVED), the failed requests (goal: none) and the publication's time.

Kinds listed in ``SCENARIO_FAULTS`` are run and printed by their scenario module
(``bench_run(fleet, workdir, rng, name=...)`` returns the run's record, naming its extra times in
``bench_times``; ``bench_line(summary, cell)`` is its line of the report).

Prints a table, writes ``bench/out/chaos.json`` (``bench/plot.py`` draws ``docs/img/recovery.png``).
Usage: python bench/chaos.py [--repeat 3] [--faults KIND,...] [--seed N]   # kinds: FAULTS
       python bench/chaos.py --rescore bench/out/chaos.json   # print (and rewrite) a recorded run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

from chaos_journal import journal_fault
from common import REPO_ROOT
from common import add_example_agents_to_path
from common import engine_log_dir
from common import machine
from common import print_table
from common import write_result as write_json

__all__ = ["FAULTS", "main", "rescore", "run_fault", "summarize_runs"]

logger = logging.getLogger(__name__)

#: Fault kinds, in the order they run.
FAULTS = (
    "engine",
    "gateway",
    "registry-host",
    "worker",
    "registry-actor",
    "rollback",
    "disk-full",
    "reopen",
    "hung-engine",
    "engine-add",
    "engine-drain",
)
#: Kinds their scenario module runs and reports (see the module docstring).
SCENARIO_FAULTS = {"hung-engine": "tests.chaos.hung_engine"}
RAY_FAULTS = frozenset({"worker", "registry-actor"})
#: Kinds that need no engine fleet (their scenarios bring scripted engines of their own).
FLEETLESS_FAULTS = frozenset({"disk-full", "reopen"})
TIMES = (
    "back_s",
    "first_publication_s",
    "first_affected_generation_s",
    "refs_released_s",
    "slots_back_s",
    "restart_releases_s",
    "rollback_retired_s",
    "rollback_reclaimed_s",
    "new_session_served_after_retired_s",
    "new_session_served_after_reclaimed_s",
    "stopped_after_full_s",
    "reopen_s",
    "back_to_normal_s",
    "published_s",
)


async def run_fault(kind: str, fleet: Any, workdir: Path, seed: int, index: int) -> dict[str, Any]:
    """One run of fault ``kind``; the scenario's report as a dict (plus the wall time)."""
    from tests.chaos import scenarios
    from tests.chaos.support import scenario_rng

    rng = scenario_rng(f"bench-{kind}-{index}", seed)
    started = time.monotonic()
    if kind in ("engine-add", "engine-drain"):  # tests/chaos/membership_load.py, goals there
        from tests.chaos.membership_load import membership_fault

        return await membership_fault(kind, fleet, workdir, rng, f"{kind}-{index}", started)
    if kind in ("disk-full", "reopen"):
        out = await journal_fault(kind, workdir, index)
        out["wall_s"] = round(time.monotonic() - started, 1)
        return out
    if kind in SCENARIO_FAULTS:
        scenario = import_module(SCENARIO_FAULTS[kind])
        out = await scenario.bench_run(fleet, workdir, rng, name=f"{kind}-{index}")
        return {**out, "kind": kind, "wall_s": round(time.monotonic() - started, 1)}
    if kind == "rollback":
        from tests.chaos.rollback_scenario import rollback_under_load

        report = await rollback_under_load(fleet, workdir, rng, name=f"{kind}-{index}")
    elif kind == "engine":
        report = await scenarios.engine_restart(fleet, workdir, rng, name=f"{kind}-{index}")
    elif kind in ("gateway", "registry-host"):
        during = "traffic" if kind == "gateway" else "publication"
        report = await scenarios.serve_killed(
            fleet, workdir, rng, during=during, name=f"{kind}-{index}"
        )
    else:
        fault = "worker" if kind == "worker" else "actor"
        report = await scenarios.ray_topology(
            fleet, workdir, rng, fault=fault, name=f"{kind}-{index}"
        )
    out = report.as_dict()
    out["kind"] = kind
    out["wall_s"] = round(time.monotonic() - started, 1)
    for key in (
        "refs_released_s",
        "slots_back_s",
        "restart_releases_s",
        "engine_start_s",
        "rollback_retired_s",
        "rollback_reclaimed_s",
        "new_session_served_after_retired_s",
        "new_session_served_after_reclaimed_s",
    ):
        if key in report.times:
            out[key] = report.times[key]
    return out


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _failed_after(run: dict[str, Any]) -> int:
    """Failed attempts that started after the fault (for the gateway kinds that includes the
    refusals while it was down: nothing was sent)."""
    for key in ("failed_after_fault", "failed_requests", "failed_while_stopped"):
        if key in run["times"]:
            return int(run["times"][key])
    return len(run["failures"].get("after", ()))


#: Goals renamed when their reading was made precise, and how to score a run recorded before.
_ENGINE_GOAL = "0 failed requests once the dead engine was out of routing"
_WORKER_GOAL = "refs released within 5 s of the owner's restart (its new lease)"
_OLD_GOALS = {
    "engine": "0 failed requests after the fault",
    "worker": "refs released within 5 s of the owner's restart",
}


def rescore(run: dict[str, Any]) -> dict[str, Any]:
    """Score a run recorded before the goals above were made precise, from what it recorded:
    an engine run's failures are already split by the detection time (``after`` is everything
    past it), a worker run has both its restart's lease opening and its predecessor's end."""
    old = _OLD_GOALS.get(run["kind"])
    if old is None or old not in run["goals"]:
        return run
    run = {**run, "goals": dict(run["goals"]), "times": dict(run["times"])}
    del run["goals"][old]
    if run["kind"] == "engine":
        after = len(run["failures"].get("after", ()))
        run["times"]["failed_after_detection"] = float(after)
        run["goals"][_ENGINE_GOAL] = after == 0
    else:
        times = run["times"]
        released = round(times["restart_releases_s"] - times["restart_lease_opened_s"], 3)
        times["restart_releases_after_lease_s"] = released
        run["goals"][_WORKER_GOAL] = released <= 5.0
    return run


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per fault kind: every time's median / min / max, failures after the fault, problems, goals."""
    out: dict[str, Any] = {}
    runs = [rescore(r) for r in runs]
    for kind in FAULTS:
        mine = [r for r in runs if r["kind"] == kind]
        if not mine:
            continue
        goals: dict[str, list[bool]] = {}
        for r in mine:
            for goal, held in r["goals"].items():
                goals.setdefault(goal, []).append(bool(held))
        out[kind] = {
            "runs": len(mine),
            **{
                t: _stats([r[t] for r in mine if r.get(t) is not None])
                for t in (*TIMES, *dict.fromkeys(t for r in mine for t in r.get("bench_times", ())))
            },
            "engine_start_s": _stats(
                [r["engine_start_s"] for r in mine if r.get("engine_start_s")]
            ),
            "failed_after_fault": sum(_failed_after(r) for r in mine),
            "failed_after_detection": sum(
                int(r["times"].get("failed_after_detection", 0)) for r in mine
            ),
            "restart_releases_after_lease_s": _stats(
                [
                    r["times"]["restart_releases_after_lease_s"]
                    for r in mine
                    if r["times"].get("restart_releases_after_lease_s") is not None
                ]
            ),
            "lost_in_flight": sum(
                len(r["failures"].get("in_flight", ())) + len(r["failures"].get("cut_by_kill", ()))
                for r in mine
            ),
            "requests": sum(r["requests"] for r in mine),
            "problems": sum(len(r["problems"]) for r in mine),
            "goals": {goal: f"{sum(h)}/{len(h)}" for goal, h in goals.items()},
        }
    return out


def _ms(stats: dict[str, Any]) -> str:
    """A median (min-max) of seconds, in milliseconds."""
    if not stats["n"]:
        return "-"
    return f"{stats['median'] * 1000:.0f} ms ({stats['min'] * 1000:.0f}-{stats['max'] * 1000:.0f})"


def report(summary: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Print the per-fault table, the goals, and every problem a run found."""

    def cell(stats: dict[str, Any]) -> str:
        if not stats["n"]:
            return "-"
        return f"{stats['median']:.1f} ({stats['min']:.1f}-{stats['max']:.1f})"

    print("\n== recovery, seconds from the fault: median (min-max) ==")
    print_table(
        ["fault", "runs", "back", "first publication", "first affected gen", "failed after",
         "lost in flight", "problems"],
        [
            [kind, s["runs"], cell(s["back_s"]), cell(s["first_publication_s"]),
             cell(s["first_affected_generation_s"]), s["failed_after_fault"], s["lost_in_flight"],
             s["problems"]]
            for kind, s in summary.items()
        ],
    )  # fmt: skip
    if "worker" in summary:
        w = summary["worker"]
        print(
            f"\nrollout worker: refs released {cell(w['refs_released_s'])}, slots back "
            f"{cell(w['slots_back_s'])} after the kill; a restart released its predecessor's "
            f"refs {cell(w['restart_releases_s'])} after it was started, "
            f"{cell(w['restart_releases_after_lease_s'])} after it opened its lease"
        )
    if "rollback" in summary:
        r = summary["rollback"]
        print(
            f"rollback under load: the rollback call took {cell(r['rollback_retired_s'])} to a "
            f"RETIRED version, {cell(r['rollback_reclaimed_s'])} to a RECLAIMED one (loaded "
            f"again); a Session opened after it served {cell(r['new_session_served_after_retired_s'])}"
            f" and {cell(r['new_session_served_after_reclaimed_s'])} after the call started; "
            f"failed requests {r['failed_after_fault']} of {r['requests']}"
        )
    if "disk-full" in summary:
        f = summary["disk-full"]
        print(
            f"full disk: fail-stop {_ms(f['stopped_after_full_s'])} after the disk was full; "
            f"{f['failed_after_fault']} requests refused while stopped; once space was freed, "
            f"reopened in {cell(f['reopen_s'])}, back to normal in {cell(f['back_to_normal_s'])}"
        )
    if "reopen" in summary:
        o = summary["reopen"]
        print(
            f"dead worker's journal reopened: refs released {cell(o['refs_released_s'])} after "
            f"the reopen (TTL 2 s + sweep 1 s), next publication {cell(o['published_s'])}"
        )
    if "engine" in summary:
        e = summary["engine"]
        print(
            f"engine start time: {cell(e['engine_start_s'])}; failed requests after the fault "
            f"{e['failed_after_fault']}, after the dead engine was out of routing "
            f"{e['failed_after_detection']}"
        )
    for kind, module in SCENARIO_FAULTS.items():
        if kind in summary:
            print(import_module(module).bench_line(summary[kind], cell))
    print("\n== goals (runs that held / runs) ==")
    for kind, s in summary.items():
        for goal, held in s["goals"].items():
            n, total = (int(x) for x in held.split("/"))
            print(f"  {'HOLDS ' if n == total else 'MISSES'}  {kind}: {goal} ({held})")
    for r in runs:
        for problem in r["problems"]:
            print(f"  problem in {r['kind']} run {r['seed_name']}: {problem}")


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    """Start a fleet (and a Ray cluster if needed), run every chosen fault ``a.repeat`` times."""
    from agentic_lora_harness.engine_env import ensure_engine_env
    from agentic_lora_harness.engines import EngineFleet
    from agentic_lora_harness.fixture import build_fixture

    from tests.chaos.support import chaos_seed
    from tests.chaos.support import fleet_left_as_found

    seed = a.seed if a.seed is not None else chaos_seed()
    started = machine()
    runs: list[dict[str, Any]] = []
    ray_up = False
    fleet_cm: contextlib.AbstractAsyncContextManager[Any] = contextlib.nullcontext(None)
    if any(kind not in FLEETLESS_FAULTS for kind in a.faults):
        env = await asyncio.to_thread(ensure_engine_env)
        fixture = await asyncio.to_thread(build_fixture)
        fleet_cm = EngineFleet(env, fixture, count=2, log_dir=engine_log_dir())
    async with fleet_cm as fleet:
        try:
            for kind in a.faults:
                if kind in RAY_FAULTS and not ray_up:
                    import ray

                    from tests.chaos.scenarios import RAY_NAMESPACE

                    ray.init(
                        num_cpus=2,
                        include_dashboard=False,
                        namespace=RAY_NAMESPACE,
                        log_to_driver=False,
                    )
                    ray_up = True
                for index in range(a.repeat):
                    with tempfile.TemporaryDirectory(prefix=f"bench-chaos-{kind}-") as tmp:
                        if kind in FLEETLESS_FAULTS:
                            run = await run_fault(kind, None, Path(tmp), seed, index)
                        else:
                            async with fleet_left_as_found(fleet):
                                run = await run_fault(kind, fleet, Path(tmp), seed, index)
                    runs.append(run)
                    print(
                        f"{kind} #{index}: back {run['back_s']} s, first publication "
                        f"{run['first_publication_s']} s, first affected generation "
                        f"{run['first_affected_generation_s']} s, problems {len(run['problems'])}"
                        f" (wall {run['wall_s']} s)",
                        flush=True,
                    )
        finally:
            if ray_up:
                import ray

                with contextlib.suppress(Exception):
                    ray.shutdown()
    started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    from tests.chaos.scenarios import AGENTS
    from tests.chaos.scenarios import LEASE_TTL

    return {
        "machine": started,
        "settings": {
            "repeat": a.repeat,
            "faults": list(a.faults),
            "seed": seed,
            "engines": 2,
            "agents": AGENTS,
            "lease_ttl": LEASE_TTL,
        },
        "summary": summarize_runs(runs),
        "runs": runs,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print, write bench/out/chaos.json."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per fault kind")
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated fault kinds, from: {', '.join(FAULTS)}",
    )
    p.add_argument("--seed", type=int, help="seed of the random fault points (default: fresh)")
    p.add_argument(
        "--rescore", type=Path, help="re-summarize a recorded run's JSON (no engines started)"
    )
    a = p.parse_args(argv)
    # The scenarios live with the chaos tests, so the benchmark measures what the tests check.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    add_example_agents_to_path()
    if a.rescore is not None:
        import json

        result = json.loads(a.rescore.read_text())
        result["runs"] = [rescore(r) for r in result["runs"]]
        result["summary"] = summarize_runs(result["runs"])
        report(result["summary"], result["runs"])
        a.rescore.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nrewritten: {a.rescore}")
        return
    a.faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    unknown = sorted(set(a.faults) - set(FAULTS))
    if unknown or a.repeat < 1:
        p.error(f"unknown faults {unknown}" if unknown else "--repeat must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = asyncio.run(main_async(a))
    report(result["summary"], result["runs"])
    print(f"\nwritten: {write_json('chaos', result)}")


if __name__ == "__main__":
    main()
