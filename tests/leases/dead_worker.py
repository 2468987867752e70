"""A dead rollout worker's leases after its journal is reopened by another process.

:func:`dead_worker_reopened` is the whole scenario, shared by the test
(``tests/leases/test_reopened_leases.py``) and ``bench/chaos.py`` (which reports its times):

1. a child process (this module run as ``python -m tests.leases.dead_worker``) opens a
   journaled registry in a :class:`~agentic_lora.assembly.deployment.Deployment` on scripted
   engines, publishes A, binds two Sessions on A under its owner lease, publishes B (A is now
   RETIRED and pinned by the two Sessions: both capacity slots are held), prints ``READY`` and
   waits;
2. the child is killed -9 (no close, no release: its lease stays in the journal);
3. this process reopens the same journal in a Deployment of its own that opens **no** Session
   (its lease keeper never opens a lease) and publishes C: SKIPPED for capacity, since A is held;
4. the registry host expires the dead worker's lease on its own (the sweeper of the reopened
   registry), the reclaimer unloads A, and C is published.

The scripted engines answer over ``respx`` inside each process, so the two processes do not share
engines: to the reopened registry every engine looks restarted, which its repairer handles (B is
loaded again from the adapter store the two processes share).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.api import in_process_core
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet

__all__ = ["ReopenReport", "dead_worker_reopened", "problems_of"]

REPO_ROOT = Path(__file__).resolve().parents[2]
A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
#: The dead worker's lease TTL (seconds): short, so the scenario takes a few seconds.
TTL = 2.0
#: A hang guard only: no verdict depends on how long anything took.
PATIENCE = 120.0


def _settings(fleet: ScriptedFleet, journal: Path, owner: str) -> AgenticLoRASettings:
    return fleet.settings(owner_id=owner, lease_ttl=TTL, journal_path=journal)


def _turn(tag: str) -> dict[str, Any]:
    return {"text": f"{tag} turn 1", "sampling_params": {"max_new_tokens": 4}}


async def _worker(journal: Path, store: Path) -> None:
    """The child: publish A, bind two Sessions on A, publish B, say READY, wait to be killed."""
    with ScriptedFleet() as fleet:
        settings = _settings(fleet, journal, "rollout-worker-0")
        options = {"store_root": str(store)}
        async with Deployment.from_settings(settings, backend_options=options) as d:
            await d.publish("A", A)
            for name in ("s1", "s2"):
                await d.versioning.open_session(name).generate(_turn(name))
            await d.publish("B", B)
            print("READY", flush=True)
            await asyncio.Event().wait()  # until SIGKILL


@dataclass
class ReopenReport:
    """What the reopened process saw, on the registry host's clock (seconds from the reopen)."""

    ttl: float
    sweep_interval: float
    refs_before: int
    first_publication: str
    #: When the dead worker's Sessions were released (the sweep that expired its lease).
    released_s: float
    #: When C committed (from the reopen), and its outcome.
    published_s: float
    later_publication: str
    a_state: str
    #: Live leases once C committed: none (the dead one expired; this process opened none).
    leases_after: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _start_worker(journal: Path, store: Path) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.leases.dead_worker",
        str(journal),
        str(store),
        cwd=REPO_ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), PATIENCE)
    if line.strip() != b"READY":
        child.kill()
        await child.wait()
        raise RuntimeError(f"the worker did not get ready (said {line!r}, rc {child.returncode})")
    return child


async def dead_worker_reopened(workdir: Path) -> ReopenReport:
    """Run the scenario (see module docstring) in ``workdir``; the report of the reopened side."""
    journal, store = workdir / "journal.sqlite", workdir / "store"
    child = await _start_worker(journal, store)
    os.killpg(child.pid, signal.SIGKILL)  # its whole process group: nothing is closed
    await child.wait()
    with ScriptedFleet() as fleet:
        settings = _settings(fleet, journal, "trainer")
        deployment = Deployment.from_settings(settings, backend_options={"store_root": str(store)})
        core = in_process_core(deployment.registry)
        feed = change_feed(deployment.registry)
        assert core is not None
        assert feed is not None
        swept = asyncio.Event()
        released: list[float] = []

        def on_change(verb: str, result: Any) -> None:
            if isinstance(result, SweepResult) and result.expired_sessions:
                released.append(core.now)  # the registry host's time of that sweep
                swept.set()

        feed.add_listener(on_change)
        reopened = time.time()  # the registry host's clock (LocalRegistry's default)
        refs_before = core.version("A").session_refs
        async with deployment as d:
            first = await d.publish("C", C)
            await asyncio.wait_for(swept.wait(), PATIENCE)
            await d.reclaimer.settled()
            later = await d.publish("C", C)
            published = time.time()
            report = ReopenReport(
                ttl=TTL,
                sweep_interval=1.0,
                refs_before=refs_before,
                first_publication=first.outcome.value,
                released_s=round(released[0] - reopened, 3),
                published_s=round(published - reopened, 3),
                later_publication=later.outcome.value,
                a_state=core.version("A").state.value,
                leases_after=[lease.lease_id for lease in core.status().leases],
            )
    return report


def problems_of(report: ReopenReport) -> list[str]:
    """Every way ``report`` falls short of the scenario's verdicts (empty: all held)."""
    problems = []
    if report.refs_before != 2:
        problems.append(f"the dead worker held {report.refs_before} refs on A, not 2")
    if report.first_publication != PublicationOutcome.SKIPPED.value:
        problems.append(f"C was {report.first_publication} while A was pinned, not SKIPPED")
    if report.released_s < report.ttl:
        problems.append(f"the refs were released {report.released_s} s after the reopen: early")
    if report.later_publication != PublicationOutcome.PUBLISHED.value:
        problems.append(f"C was {report.later_publication} after the release, not PUBLISHED")
    if report.a_state != VersionState.RECLAIMED.value:
        problems.append(f"A is {report.a_state} after C, not RECLAIMED")
    if report.leases_after:
        problems.append(f"leases still live at the end: {report.leases_after}")
    return problems


if __name__ == "__main__":
    asyncio.run(_worker(Path(sys.argv[1]), Path(sys.argv[2])))
