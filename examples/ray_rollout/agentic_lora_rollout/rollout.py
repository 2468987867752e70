"""One rollout: the trainer publishes versions while Ray rollout workers run agent episodes.

:func:`rollout` is the whole example on a running fleet (any engines: the harness's, or real GPU
engines): registry actor, trainer Deployment, ``workers`` worker actors with ``agents`` agents
each, the first version published before the workers start and every further one after each
worker has had ``turns_between`` more answered turns; after each publication every worker
answers a turn on the new version (a new episode bound it) before the run goes on. A publication refused for capacity (the
version before the previous one is still held by a running Session) is tried again after a
reclaim round. Then the workers stop (every Session closed, every lease closed), the retired
versions are reclaimed, and every episode is written with its provenance to
``<workdir>/episodes.jsonl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState

from .driver import REGISTRY_NAMESPACE
from .driver import fleet_settings
from .driver import reclaim_until_settled
from .driver import registry_actor
from .driver import spawn_worker
from .driver import trainer_deployment
from .driver import worker_settings
from .worker import WorkerConfig

__all__ = ["RolloutReport", "publish_when_free", "rollout"]

_TOO_STALE = "VERSION_TOO_STALE"


@dataclass
class RolloutReport:
    """What a rollout did; :meth:`problems` lists every invariant that did not hold."""

    publications: list[PublicationResult] = field(default_factory=list)
    episodes: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: RegistryStatus | None = None
    episodes_path: Path | None = None
    #: The bound the workers ran with: with one, VERSION_TOO_STALE refusals are expected.
    max_version_lag: int | None = None

    def problems(self) -> list[str]:
        """The client-side checks (the end-to-end test checks the same from the engine side).

        * every publication committed;
        * every episode's requests carried one adapter, the one its provenance names;
        * no attempt failed (no refusal, no indeterminate request, no aborted turn), except
          ``VERSION_TOO_STALE`` refusals when a ``max_version_lag`` was set;
        * every version retired during the run was reclaimed once the workers stopped.
        """
        found = [f"agent loop error: {e}" for e in self.errors]
        found += [
            f"publication {p.version_id}: {p.outcome.value} ({p.reason})"
            for p in self.publications
            if not p.ok
        ]
        for ep in self.episodes:
            names = {a["lora_name"] for a in ep["attempts"]}
            prov = ep["provenance"] or {}
            if names != {prov.get("lora_name")}:
                found.append(
                    f"{ep['session']}: adapters {sorted(map(str, names))}, provenance {prov}"
                )
            failed = [
                a
                for a in ep["attempts"]
                if a["outcome"] != "ok"
                and not (self.max_version_lag is not None and a["error_code"] == _TOO_STALE)
            ]
            if failed:
                found.append(
                    f"{ep['session']}: failed attempts "
                    + ", ".join(f"{a['outcome']} {a['error_code']}" for a in failed)
                )
        if self.final is not None:
            committed = {p.version_id for p in self.publications if p.ok}
            for v in self.final.versions:
                if (
                    v.version_id in committed
                    and v.version_id != self.final.default_version
                    and v.state is not VersionState.RECLAIMED
                ):
                    found.append(f"retired version {v.version_id} is {v.state.value}")
        return found

    def too_stale(self) -> int:
        """Episodes that ended with a ``VERSION_TOO_STALE`` refusal."""
        return sum(1 for ep in self.episodes if ep["error_code"] == _TOO_STALE)

    def versions_used(self) -> dict[str, int]:
        """Episodes per bound version id."""
        out: dict[str, int] = {}
        for ep in self.episodes:
            vid = (ep["provenance"] or {}).get("version_id")
            out[str(vid)] = out.get(str(vid), 0) + 1
        return out


async def publish_when_free(
    deployment: Deployment,
    version_id: str,
    snapshot: AdapterSnapshot,
    *,
    deadline_s: float = 180.0,
    pause_s: float = 0.5,
) -> PublicationResult:
    """Publish; while refused for capacity, run a reclaim round and try again (bounded).

    SKIPPED means both slots are taken: the default, and a retired version some running Session
    still holds. Its Sessions end with their episodes, in the workers' processes; a reclaim round
    here then frees the slot.
    """
    give_up = time.monotonic() + deadline_s
    while True:
        result = await deployment.publish(version_id, snapshot)
        if result.outcome is not PublicationOutcome.SKIPPED or time.monotonic() > give_up:
            return result
        await deployment.reclaim()
        await asyncio.sleep(pause_s)


async def rollout(
    engines: Mapping[str, str],
    *,
    base_model: str,
    adapters: Sequence[Path],
    workdir: Path,
    workers: int = 2,
    agents: int = 2,
    turns_between: int = 6,
    max_version_lag: int | None = None,
    lease_ttl: float = 30.0,
    on_event: Any = print,
) -> RolloutReport:
    """Run the example on a running fleet (``engines``: name -> base URL); needs ``ray.init``.

    ``adapters`` are PEFT directories published in order as versions ``step-<i>``.
    """
    import ray

    tag = uuid.uuid4().hex[:6]
    report = RolloutReport(max_version_lag=max_version_lag)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    registry_name = f"rollout-registry-{tag}"
    fleet = fleet_settings(engines, base_model=base_model)
    # Every worker's settings are validated here, before any actor starts.
    configs = [
        WorkerConfig(
            settings=worker_settings(
                fleet,
                owner=f"rollout-worker-{i}-{tag}",
                lease_ttl=lease_ttl,
                max_version_lag=max_version_lag,
            ),
            registry_name=registry_name,
            namespace=REGISTRY_NAMESPACE,
            agents=agents,
        )
        for i in range(workers)
    ]
    registry = registry_actor(fleet, name=registry_name, journal=workdir / "registry.sqlite")
    deployment = trainer_deployment(registry, fleet, store_root=workdir / "adapter-store")
    handles: list[Any] = []
    try:
        async with deployment:
            snapshots = [AdapterSnapshot.from_peft_dir(p) for p in adapters]
            first = await deployment.publish(f"step-0-{tag}", snapshots[0])
            report.publications.append(first)
            on_event(f"published step-0-{tag}: {first.outcome.value}")
            if not first.ok:
                raise RuntimeError(f"the first publication failed: {first}")
            handles = [spawn_worker(c) for c in configs]
            started = await asyncio.gather(*(h.start.remote() for h in handles))
            on_event(
                "workers started: " + ", ".join(f"{s['owner']} pid {s['pid']}" for s in started)
            )
            for i, snapshot in enumerate(snapshots[1:], start=1):
                await asyncio.gather(*(h.wait_answered.remote(i * turns_between) for h in handles))
                result = await publish_when_free(deployment, f"step-{i}-{tag}", snapshot)
                report.publications.append(result)
                on_event(f"published step-{i}-{tag} during the rollout: {result.outcome.value}")
                if result.ok and result.lora_name is not None:
                    # Every worker's new episodes bind it while older Sessions keep theirs.
                    await asyncio.gather(
                        *(h.wait_answered_on.remote(result.lora_name) for h in handles)
                    )
            for stopped in await asyncio.gather(*(h.stop.remote() for h in handles)):
                report.episodes += stopped["episodes"]
                report.errors += stopped["errors"]
            on_event(f"workers stopped: {len(report.episodes)} episodes")
            report.final = await reclaim_until_settled(deployment)
            on_event(
                "reclaimed: "
                + ", ".join(f"{v.version_id} {v.state.value}" for v in report.final.versions)
            )
    finally:
        for h in handles:
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        with contextlib.suppress(Exception):
            ray.kill(registry.actor, no_restart=True)
    report.episodes_path = workdir / "episodes.jsonl"
    lines = "".join(json.dumps(ep, separators=(",", ":")) + "\n" for ep in report.episodes)
    await asyncio.to_thread(report.episodes_path.write_text, lines)
    return report
