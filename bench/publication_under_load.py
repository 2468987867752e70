"""Publication under load: agents keep generating on two real SGLang engines while versions change.

The run, on one timeline (every time below is seconds since agent traffic started)::

    publish A (bootstrap) -> start agents -> warm-up
    -> [baseline window] [publish B ... A reclaimed ... window end]
    -> [baseline window] [publish C ... B reclaimed ... window end]  ... (--cycles)
    -> [baseline window] -> stop agents

* Agents: ``--agents`` concurrent loops of the example tool-using agent
  (``examples/agents``, scripted fallback policy: the tiny fixture model emits noise), each
  episode one Session of several chat-completion turns, then the next episode. Every request is
  recorded (start, end, version, engine, outcome).
* A publication window opens when ``publish`` is called and lasts ``--window`` seconds, or until
  the version it retired is RECLAIMED on both engines if that takes longer. Baseline windows of
  the same length sit between publications, so both kinds share the machine's drift.
* The active part of each publication window (from ``publish`` to the retired version's
  reclaim) is also reported on its own.
* Per window: request latency p50/p95/p99 (requests completed inside it), the longest interval
  in which no request completed (window edges count), failed requests.
* Publication phases come from the publisher's result (reserve, per-engine prepare, commit...);
  reclaim phases from the progress events; the registry is sampled every 0.1 s for the versions
  in use (Session refs per version, state, default).

Targets (issue 7): 0 failed requests; max no-progress gap during publication <= 1.5x the same
run's baseline windows; publication p99 <= 1.2x baseline p99. The RFC's GPU run is printed
alongside for comparison.

Prints a table and writes ``bench/out/publication_under_load.json`` (the plot script draws the
timeline from it).

Usage: python bench/publication_under_load.py [--agents 8] [--cycles 5] [--window 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from common import add_example_agents_to_path
from common import engine_log_dir
from common import fleet_settings
from common import machine
from common import max_gap
from common import print_table
from common import summarize
from common import write_result

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.types import VersionState

add_example_agents_to_path()

from agentic_lora_agent import AgentConfig  # noqa: E402
from agentic_lora_agent import AgentObserver  # noqa: E402
from agentic_lora_agent import AttemptOutcome  # noqa: E402
from agentic_lora_agent import AttemptRecord  # noqa: E402
from agentic_lora_agent import Episode  # noqa: E402
from agentic_lora_agent import EpisodeStatus  # noqa: E402
from agentic_lora_agent import ScriptedPolicy  # noqa: E402
from agentic_lora_agent import ToolAgent  # noqa: E402
from agentic_lora_agent import default_toolbox  # noqa: E402
from agentic_lora_agent import task_for  # noqa: E402

__all__ = ["Run", "agent_loop", "analyse", "main", "pooled", "window_stats"]

RFC_GPU = {
    "failed": 0,
    "max_gap_s": 0.335,
    "gap_bound_s": 2.0,
    "p50": 0.271,
    "p95": 0.318,
    "p99": 0.322,
}
GAP_FACTOR = 1.5
P99_FACTOR = 1.2
LETTERS = ("A", "B", "C")


@dataclass
class Run:
    """Everything observed in one run, on the perf_counter clock (``t0``: traffic start)."""

    t0: float = 0.0
    attempts: list[tuple[int, AttemptRecord]] = field(default_factory=list)  # (agent, record)
    episodes: list[Episode] = field(default_factory=list)
    loop_errors: list[str] = field(default_factory=list)
    events: list[tuple[float, PhaseEvent]] = field(default_factory=list)
    registry: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    publications: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # lora_name -> short label

    def rel(self, t: float) -> float:
        return t - self.t0


class Recorder(AgentObserver):
    """Keeps every attempt an agent makes, tagged with the agent's index."""

    def __init__(self, run: Run, agent: int) -> None:
        self._run = run
        self._agent = agent

    def on_attempt(self, agent: ToolAgent, record: AttemptRecord) -> None:
        self._run.attempts.append((self._agent, record))


async def agent_loop(
    index: int, deployment: Deployment, stop: asyncio.Event, run: Run, config: AgentConfig
) -> None:
    """Episode after episode (one Session each) until ``stop``; failures are recorded, not hidden."""
    tools = default_toolbox()
    policy = ScriptedPolicy()
    episode = 0
    while not stop.is_set():
        try:
            async with deployment.session(f"agent{index}-ep{episode}") as session:
                agent = ToolAgent(
                    session,
                    task_for(index, episode),
                    tools=tools,
                    config=config,
                    policy=policy,
                    observer=Recorder(run, index),
                )
                run.episodes.append(await agent.run())
        except Exception as exc:
            run.loop_errors.append(f"agent {index} episode {episode}: {type(exc).__name__}: {exc}")
        episode += 1


async def sample_registry(deployment: Deployment, stop: asyncio.Event, run: Run) -> None:
    """Versions in use over time: state and Session refs per version, and the default."""
    while not stop.is_set():
        status = await deployment.status()
        run.registry.append(
            {
                "t": run.rel(time.perf_counter()),
                "default": status.default_version,
                "versions": {
                    v.version_id: {"state": v.state.value, "refs": v.session_refs}
                    for v in status.versions
                },
            }
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.1)


async def wait_reclaimed(deployment: Deployment, version_id: str, limit: float) -> bool:
    """Poll (benchmark cadence, 50 ms) until ``version_id`` is RECLAIMED; False after ``limit`` s."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        if (await deployment.registry.version(version_id)).state is VersionState.RECLAIMED:
            return True
        await asyncio.sleep(0.05)
    return False


def _phase_table(result: PublicationResult) -> list[dict[str, Any]]:
    return [
        {"engine": t.engine, "phase": t.phase.value, "seconds": t.seconds, "ok": t.ok}
        for t in result.timings
    ]


async def publish_cycle(
    deployment: Deployment,
    run: Run,
    *,
    version_id: str,
    snapshot: AdapterSnapshot,
    retiring: str,
    window: float,
    reclaim_timeout: float,
) -> None:
    """One publication window: publish, wait for the retired version's reclaim, fill the window."""
    opened = time.perf_counter()
    result = await deployment.publish(version_id, snapshot)
    committed = time.perf_counter()
    if result.lora_name is not None:
        run.labels[result.lora_name] = version_id.split("-")[0]
    reclaimed = await wait_reclaimed(deployment, retiring, reclaim_timeout) if result.ok else False
    reclaimed_at = time.perf_counter()
    remaining = window - (reclaimed_at - opened)
    if remaining > 0:
        await asyncio.sleep(remaining)
    closed = time.perf_counter()
    run.windows.append({"kind": "publication", "start": run.rel(opened), "end": run.rel(closed)})
    run.publications.append(
        {
            "version": version_id,
            "retired": retiring,
            "outcome": result.outcome.value,
            "publish_seconds": committed - opened,
            "commit_at": run.rel(committed),
            "retired_reclaimed": reclaimed,
            "commit_to_reclaimed_seconds": reclaimed_at - committed if reclaimed else None,
            "reclaimed_at": run.rel(reclaimed_at) if reclaimed else None,
            # From publish() to the retired version's reclaim: where the publication acts.
            "active": {"start": run.rel(opened), "end": run.rel(reclaimed_at)},
            "phases": _phase_table(result),
        }
    )


async def baseline(run: Run, window: float) -> None:
    """A window with no publication in it."""
    start = time.perf_counter()
    await asyncio.sleep(window)
    run.windows.append(
        {"kind": "baseline", "start": run.rel(start), "end": run.rel(time.perf_counter())}
    )


# --- analysis ------------------------------------------------------------------------------------


def _ends(run: Run) -> list[tuple[float, float, AttemptRecord]]:
    return [(run.rel(r.started_at + r.latency_s), r.latency_s, r) for _, r in run.attempts]


def window_stats(run: Run, start: float, end: float) -> dict[str, Any]:
    """Latency, failures and the longest no-progress gap of requests completed in [start, end]."""
    inside = [(t, lat, r) for t, lat, r in _ends(run) if start <= t <= end]
    ok = [lat for _, lat, r in inside if r.outcome is AttemptOutcome.OK]
    done = [t for t, _, r in inside if r.outcome is AttemptOutcome.OK]
    lat = summarize(ok)
    return {
        "start": start,
        "end": end,
        "requests": len(inside),
        "failed": sum(1 for _, _, r in inside if r.outcome is not AttemptOutcome.OK),
        "p50": lat.p50,
        "p95": lat.p95,
        "p99": lat.p99,
        "max_gap_s": max_gap(done, start, end),
    }


def pooled(spans: Sequence[tuple[float, float]], run: Run) -> dict[str, Any]:
    """Several windows together: pooled latency, the largest gap, total failures."""
    inside = [(lat, r) for t, lat, r in _ends(run) if any(a <= t <= b for a, b in spans)]
    lat = summarize(lat for lat, r in inside if r.outcome is AttemptOutcome.OK)
    gaps = [window_stats(run, a, b)["max_gap_s"] for a, b in spans]
    return {
        "windows": len(spans),
        "seconds": sum(b - a for a, b in spans),
        "requests": len(inside),
        "failed": sum(1 for _, r in inside if r.outcome is not AttemptOutcome.OK),
        "p50": lat.p50,
        "p95": lat.p95,
        "p99": lat.p99,
        "max_gap_s": max(gaps) if gaps else float("nan"),
    }


def analyse(run: Run) -> dict[str, Any]:
    """Windows, pooled comparisons, failures, phases and the targets."""
    for w in run.windows:
        w.update(window_stats(run, w["start"], w["end"]))
    for p in run.publications:
        p["active"].update(window_stats(run, p["active"]["start"], p["active"]["end"]))

    def spans(kind: str) -> list[tuple[float, float]]:
        return [(w["start"], w["end"]) for w in run.windows if w["kind"] == kind]

    base, pub = pooled(spans("baseline"), run), pooled(spans("publication"), run)
    active = pooled([(p["active"]["start"], p["active"]["end"]) for p in run.publications], run)
    failed_attempts = [r for _, r in run.attempts if r.outcome is not AttemptOutcome.OK]
    unanswered = [e for e in run.episodes if e.status is not EpisodeStatus.ANSWERED]
    mixed = [e.session_id for e in run.episodes if len(e.lora_names) > 1]
    failed_total = len(failed_attempts) + len(run.loop_errors)
    all_ok = summarize(r.latency_s for _, r in run.attempts if r.outcome is AttemptOutcome.OK)
    gap_ratio = pub["max_gap_s"] / base["max_gap_s"] if base["max_gap_s"] else float("nan")
    p99_ratio = pub["p99"] / base["p99"] if base["p99"] else float("nan")
    return {
        "requests": len(run.attempts),
        "episodes": len(run.episodes),
        "failed_requests": failed_total,
        "failed_examples": [
            f"{r.outcome.value} {r.error_code}: {r.error}" for r in failed_attempts[:5]
        ]
        + run.loop_errors[:5],
        "episodes_not_answered": len(unanswered),
        "sessions_with_more_than_one_version": mixed,
        "all_requests": {"p50": all_ok.p50, "p95": all_ok.p95, "p99": all_ok.p99},
        "baseline": base,
        "publication": pub,
        "publication_active": active,
        "gap_ratio": gap_ratio,
        "p99_ratio": p99_ratio,
        "targets": {
            "0 failed requests": failed_total == 0,
            f"max gap <= {GAP_FACTOR}x baseline": gap_ratio <= GAP_FACTOR,
            f"p99 <= {P99_FACTOR}x baseline": p99_ratio <= P99_FACTOR,
        },
        "rfc_gpu": RFC_GPU,
    }


def timeline(run: Run) -> dict[str, Any]:
    """What the plot needs: every request, registry samples, windows, phase events."""
    return {
        "requests": [
            {
                "agent": agent,
                "start": run.rel(r.started_at),
                "end": run.rel(r.started_at + r.latency_s),
                "version": run.labels.get(r.lora_name or "", r.lora_name),
                "engine": r.engine,
                "outcome": r.outcome.value,
            }
            for agent, r in run.attempts
        ],
        "registry": run.registry,
        "events": [
            {
                "t": run.rel(t),
                "engine": e.engine,
                "phase": e.phase.value,
                "status": e.status.value,
                "seconds": e.seconds,
            }
            for t, e in run.events
        ],
    }


# --- the run -------------------------------------------------------------------------------------


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    """Start the fleet, publish A, run agents through ``a.cycles`` publications, analyse."""
    from agentic_lora_harness.engine_env import ensure_engine_env
    from agentic_lora_harness.engines import EngineFleet
    from agentic_lora_harness.fixture import build_fixture

    started = machine()
    env = await asyncio.to_thread(ensure_engine_env)
    fixture = await asyncio.to_thread(build_fixture)
    run = Run()
    tag = uuid.uuid4().hex[:6]
    snapshots = {x: AdapterSnapshot.from_peft_dir(fixture.adapter(x)) for x in LETTERS}
    config = AgentConfig(
        max_turns=6,
        max_tokens=a.max_tokens,
        temperature=0.0,
        # Fixed-length turns: every window's requests do the same work.
        extra_body={"ignore_eos": True},
    )
    async with EngineFleet(env, fixture, count=2, log_dir=engine_log_dir()) as fleet:
        settings = fleet_settings(fleet)
        with tempfile.TemporaryDirectory(prefix="bench-publication-") as store:
            deployment = Deployment.from_settings(
                settings,
                backend_options={"store_root": store},
                on_progress=lambda e: run.events.append((time.perf_counter(), e)),
            )
            async with deployment:
                current = f"A0-{tag}"
                first = await deployment.publish(current, snapshots["A"])
                if not first.ok or first.lora_name is None:
                    raise RuntimeError(f"bootstrap publication failed: {first}")
                run.labels[first.lora_name] = "A0"
                bootstrap = {"version": current, "phases": _phase_table(first)}
                stop = asyncio.Event()
                run.t0 = time.perf_counter()
                agents = [
                    asyncio.create_task(agent_loop(i, deployment, stop, run, config))
                    for i in range(a.agents)
                ]
                sampler = asyncio.create_task(sample_registry(deployment, stop, run))
                try:
                    await asyncio.sleep(a.warmup)
                    for cycle in range(1, a.cycles + 1):
                        await baseline(run, a.window)
                        letter = LETTERS[cycle % len(LETTERS)]
                        version = f"{letter}{cycle}-{tag}"
                        await publish_cycle(
                            deployment,
                            run,
                            version_id=version,
                            snapshot=snapshots[letter],
                            retiring=current,
                            window=a.window,
                            reclaim_timeout=a.reclaim_timeout,
                        )
                        current = version
                        print(f"cycle {cycle}: {run.publications[-1]['outcome']} {version}")
                    await baseline(run, a.window)
                finally:
                    stop.set()
                    await asyncio.gather(*agents, sampler)
    started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "machine": started,
        "settings": {
            "agents": a.agents,
            "cycles": a.cycles,
            "window_s": a.window,
            "warmup_s": a.warmup,
            "max_tokens": a.max_tokens,
            "engines": 2,
        },
        "bootstrap": bootstrap,
        "windows": run.windows,
        "publications": run.publications,
        "summary": analyse(run),
        "timeline": timeline(run),
    }


def report(result: dict[str, Any]) -> None:
    """Print windows, publication phases, the pooled comparison and the targets."""
    s = result["summary"]
    print("\n== windows (latency of requests completed inside, seconds) ==")
    print_table(
        ["window", "from", "to", "requests", "failed", "p50", "p95", "p99", "max gap"],
        [
            [w["kind"], w["start"], w["end"], w["requests"], w["failed"], w["p50"], w["p95"],
             w["p99"], w["max_gap_s"]]
            for w in result["windows"]
        ],
    )  # fmt: skip
    print("\n== publications ==")
    for p in result["publications"]:
        phases = ", ".join(
            f"{ph['phase']}{'@' + ph['engine'] if ph['engine'] else ''} {ph['seconds']:.3f}"
            for ph in p["phases"]
        )
        drain = p["commit_to_reclaimed_seconds"]
        when = f"{drain:.3f} s after commit" if drain is not None else "NOT reclaimed"
        print(
            f"{p['version']}: {p['outcome']} in {p['publish_seconds']:.3f} s; "
            f"retired {p['retired']} reclaimed {when}"
        )
        print(f"   phases: {phases}")
    print("\n== pooled: publication windows vs baseline windows (same run) ==")
    rfc = s["rfc_gpu"]
    print_table(
        ["", "requests", "failed", "p50 s", "p95 s", "p99 s", "max gap s"],
        [
            ["baseline", s["baseline"]["requests"], s["baseline"]["failed"], s["baseline"]["p50"],
             s["baseline"]["p95"], s["baseline"]["p99"], s["baseline"]["max_gap_s"]],
            ["publication", s["publication"]["requests"], s["publication"]["failed"],
             s["publication"]["p50"], s["publication"]["p95"], s["publication"]["p99"],
             s["publication"]["max_gap_s"]],
            ["publish->reclaimed", s["publication_active"]["requests"],
             s["publication_active"]["failed"], s["publication_active"]["p50"],
             s["publication_active"]["p95"], s["publication_active"]["p99"],
             s["publication_active"]["max_gap_s"]],
            ["RFC GPU run", 97, rfc["failed"], rfc["p50"], rfc["p95"], rfc["p99"], rfc["max_gap_s"]],
        ],
    )  # fmt: skip
    print(
        f"\n{s['requests']} requests in {s['episodes']} episodes; failed {s['failed_requests']}; "
        f"Sessions that saw two versions: {len(s['sessions_with_more_than_one_version'])}; "
        f"gap ratio {s['gap_ratio']:.2f}, p99 ratio {s['p99_ratio']:.2f}"
    )
    for name, held in s["targets"].items():
        print(f"  {'HOLDS ' if held else 'MISSED'}  {name}")
    for example in s["failed_examples"]:
        print(f"  failure: {example}")


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print, write bench/out/publication_under_load.json."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--agents", type=int, default=8, help="concurrent agent loops")
    p.add_argument("--cycles", type=int, default=5, help="publications (each retires one)")
    p.add_argument("--window", type=float, default=10.0, help="seconds per window")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per turn")
    p.add_argument("--reclaim-timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    if a.agents < 1 or a.cycles < 1 or a.window <= 0:
        p.error("--agents and --cycles must be positive, --window > 0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = asyncio.run(main_async(a))
    report(result)
    print(f"\nwritten: {write_result('publication_under_load', result)}")


if __name__ == "__main__":
    main()
