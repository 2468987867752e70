"""The driver's side: the registry actor, the trainer's Deployment, and the rollout worker actors.

The driver (the trainer's process) owns the named registry actor
(:func:`~agentic_lora.registry.ray_actor.connect`, journaled) and the only publisher and reclaimer
(a :class:`~agentic_lora.assembly.deployment.Deployment` on the actor's client). Rollout workers are Ray
actors in their own processes (:func:`spawn_worker`); they find the registry by name.

The fleet is described once, here: :func:`fleet_settings` validates it in the driver, the registry
actor and the trainer's Deployment are built from it, and :func:`worker_settings` derives each
worker's settings from it (adding the worker slot's owner id, lease TTL and staleness bound). The
workers receive those settings already validated, so a bad value fails in the driver, before any
actor starts, and no worker can disagree with the trainer about the fleet, its capacity or the
adapter name prefix.

A reclaim can only start in the driver, but the releases that make a retired version reclaimable
happen in the workers' processes, which cannot poke the driver's reclaimer:
:func:`reclaim_until_settled` runs rounds until nothing is left to reclaim (a trainer would run
one before each publication, or every few seconds).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import agentic_lora_agent

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.registry.ray_actor import connect
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState

from .worker import RolloutWorker
from .worker import WorkerConfig

__all__ = [
    "REGISTRY_NAMESPACE",
    "fleet_settings",
    "reclaim_until_settled",
    "registry_actor",
    "settled",
    "spawn_worker",
    "trainer_deployment",
    "worker_runtime_env",
    "worker_settings",
]

#: The Ray namespace the example's registry actor lives in.
REGISTRY_NAMESPACE = "agentic-lora-rollout"

#: Versions a reclaim round still has to finish.
_UNFINISHED = frozenset(
    {VersionState.LOADING, VersionState.ABORTED, VersionState.RETIRED, VersionState.RECLAIMING}
)


def worker_runtime_env() -> dict[str, Any]:
    """A Ray ``runtime_env`` whose workers can import this package and the example agent.

    Ray puts only the driver's working directory on a worker's ``sys.path``; the two example
    packages live elsewhere, so they go on the workers' ``PYTHONPATH``.
    """
    here = Path(__file__).resolve().parents[1]
    agents = Path(agentic_lora_agent.__file__).resolve().parents[1]
    paths = [str(here), str(agents), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def fleet_settings(
    engines: Mapping[str, str], *, base_model: str, prefix: str = "policy_lora"
) -> AgenticLoRASettings:
    """The fleet's validated settings (``engines``: name -> base URL), for the trainer and, via
    :func:`worker_settings`, every rollout worker.

    Raises :class:`~agentic_lora.errors.ConfigurationError` (its ``check`` names the rule) on a
    bad value. The engines must run with ``--max-loaded-loras 3 --max-loras-per-batch 3`` (as the
    harness starts them): room for the ``capacity`` of 2 versions plus one.
    """
    return load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}" for name, url in engines.items()],
        capacity=2,
        base_model_name=base_model,
        engine_max_loaded_loras=3,
        engine_max_loras_per_batch=3,
        lora_name_prefix=prefix,
        request_timeout=120.0,
    )


def worker_settings(
    fleet: AgenticLoRASettings,
    *,
    owner: str,
    lease_ttl: float = 60.0,
    max_version_lag: int | None = None,
) -> AgenticLoRASettings:
    """One rollout worker's settings: the fleet's, plus the worker slot's stable ``owner`` id,
    its lease TTL and its staleness bound (``max_version_lag``; None sets no bound).

    Validated again as a whole, so a bad owner id or TTL raises
    :class:`~agentic_lora.errors.ConfigurationError` here, in the driver.
    """
    return load_settings(
        **{
            **dict(fleet),
            "owner_id": owner,
            "lease_ttl": lease_ttl,
            "max_version_lag": max_version_lag,
        }
    )


def registry_actor(settings: AgenticLoRASettings, *, name: str, journal: Path) -> RayRegistryClient:
    """The named, detached, journaled registry actor (created here; workers look it up), whose
    identity is the fleet's: the servers that hold adapters, capacity, epoch and name prefix."""
    return connect(
        **settings.registry_identity,
        journal_path=journal,
        name=name,
        namespace=REGISTRY_NAMESPACE,
    )


def trainer_deployment(
    registry: RayRegistryClient, settings: AgenticLoRASettings, *, store_root: Path
) -> Deployment:
    """The trainer's publisher and reclaimer on the shared registry (the ``http-push`` backend,
    writing adapter directories under ``store_root``, which the engines must read at that path).

    It opens no Sessions, so its own owner lease (opened at a first bind) never opens.
    """
    # Built from backend_options, the backend is the Deployment's: its aclose closes it.
    return Deployment.from_settings(
        settings, backend_options={"store_root": store_root}, registry=registry
    )


def spawn_worker(config: WorkerConfig) -> Any:
    """Start one rollout worker actor (its own process); call ``start`` on it next.

    ``max_restarts=0``: a dead worker stays dead; the framework starts a new one for the same
    ``owner`` slot, and that restart releases the dead one's Sessions. ``num_cpus=0``: the
    workers wait on engines, they do not compute.
    """
    import ray

    actor = ray.remote(RolloutWorker).options(
        num_cpus=0,
        max_restarts=0,
        max_task_retries=0,
        runtime_env=worker_runtime_env(),
    )
    return actor.remote(config)


def settled(status: RegistryStatus) -> bool:
    """Nothing pending, retired or reclaiming: the only slot in use is the default's."""
    return status.pending_version is None and not any(
        v.state in _UNFINISHED for v in status.versions
    )


async def reclaim_until_settled(
    deployment: Deployment, *, deadline_s: float = 120.0, pause_s: float = 0.5
) -> RegistryStatus:
    """Reclaim rounds until the registry is :func:`settled`; raises TimeoutError past the
    deadline (a Session some worker never closed keeps its version)."""
    give_up = time.monotonic() + deadline_s
    while True:
        await deployment.reclaim()
        status = await deployment.status()
        if settled(status):
            return status
        if time.monotonic() > give_up:
            raise TimeoutError(
                "not settled: "
                + ", ".join(
                    f"{v.version_id}={v.state.value}/{v.session_refs}" for v in status.versions
                )
            )
        await asyncio.sleep(pause_s)
