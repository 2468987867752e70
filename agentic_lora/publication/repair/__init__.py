"""Engine repair: an engine that restarted gets back every version that may still be dispatched.

A new engine incarnation is a new process, and a new process holds no adapter. The registry voids
that engine's READY for every dispatchable version as soon as it observes the new incarnation
(:meth:`~agentic_lora.registry.core.RegistryCore.observe_incarnation`), so the dispatch chain
stops routing those versions there at once (``VersionStatus.ready_engines`` is the set of
holders). The :class:`Repairer` then puts them back::

    every probe_interval, and at once when poked (an engine refused a versioned dispatch):
        per engine: backend.incarnation -> observe_incarnation (only when it changed)
        per version PUBLISHED, or RETIRED with Session refs, lacking a probed engine:
            take the version's lock -> re-read it -> snapshot -> per lacking engine, concurrently:
                prepare (store, load pinned, probe) -> record_ready (committed attempt, the
                engine's current incarnation) -> the router may send the version there again

Rules, and what each one prevents:

* Only PUBLISHED versions and RETIRED versions that Sessions still hold are loaded again. A
  RETIRED version without refs belongs to the reclaimer (loading it would only delay its unload),
  a LOADING one to its publisher (whose incarnation check before commit already voids a READY
  from the old process), RECLAIMING/RECLAIMED ones to nobody: the registry counts a restart as
  their unload.
* Repair and reclaim of the same version never overlap: both take the version's lock in
  :class:`VersionLocks` (the reclaimer around its claim, a repair from its re-read to its
  record), so a claim waits for a running repair and a repair that starts after a claim sees
  RECLAIMING and does nothing. Without it a repair finishing after the reclaim's unload would
  leave the adapter loaded with nobody left to unload it.
* A READY that does not count (the version left the dispatchable states meanwhile, e.g. claimed
  by another process's reclaimer, which the lock cannot see: the registry takes the late READY
  without counting it, reported as ``INVALID_STATE``; or any refusal once the version is no
  longer dispatchable) means the copy just loaded must go: the repairer cleans it up
  (``backend.cleanup`` of the committed attempt). ``ENGINE_RESTARTED`` while the version is still dispatchable is *not*
  cleaned: the copy either died with the old process or sits, unrecorded and therefore never
  routed to, on the new one, where the next round's prepare finds it (HTTP push: already listed
  at its store path, so no second load) and records it. Cleaning it instead would fence the
  committed attempt in the backend (a cleaned attempt is never prepared again) and make the
  version unrepairable on that engine. A READY whose reply was lost is never cleaned: it may be
  recorded, and routed to.
* Repairs fit the engine's pinned slots by construction: every version repaired holds one of the
  registry's ``capacity`` slots, and start-up refuses engines whose ``max_loras_per_batch - 1``
  pinned slots are fewer than ``capacity``.
* The content comes from a :class:`SnapshotSource`: the Deployment's :class:`SnapshotCache` keeps
  what it published (evicted once the version is reclaimed) and falls back to the backend's
  immutable store (``stored_snapshot``, HTTP push and vLLM), so a restarted publisher can still
  repair. A version whose content cannot be had is reported (warning log, a progress event with
  ``error_code="SNAPSHOT_UNAVAILABLE"``, :attr:`Repairer.outcomes`) and retried every round; its
  Sessions keep going to the engines that hold it, or get ``VERSION_UNAVAILABLE``.

The probe also feeds routing and readiness: an engine whose incarnation cannot be read is marked
unhealthy in the given :class:`~agentic_lora.engines.routing.EngineHealth` (so Sessions go to the other
holders while it is down) and healthy again once it answers; :meth:`Repairer.readiness` is false
once the registry fail-stopped or stopped answering, or while no engine answers.
"""

from agentic_lora.publication.repair.locks import VersionLocks
from agentic_lora.publication.repair.probe import EngineProbe
from agentic_lora.publication.repair.probe import ProbeResult
from agentic_lora.publication.repair.probe import Readiness
from agentic_lora.publication.repair.repairer import SNAPSHOT_UNAVAILABLE
from agentic_lora.publication.repair.repairer import Repairer
from agentic_lora.publication.repair.repairer import RepairOutcome
from agentic_lora.publication.repair.repairer import RepairReport
from agentic_lora.publication.repair.repairer import RepairResult
from agentic_lora.publication.repair.repairer import repairable
from agentic_lora.publication.repair.snapshots import SnapshotCache
from agentic_lora.publication.repair.snapshots import SnapshotSource
from agentic_lora.publication.repair.snapshots import StoredSnapshot

__all__ = [
    "SNAPSHOT_UNAVAILABLE",
    "EngineProbe",
    "ProbeResult",
    "Readiness",
    "RepairOutcome",
    "RepairReport",
    "RepairResult",
    "Repairer",
    "SnapshotCache",
    "SnapshotSource",
    "StoredSnapshot",
    "VersionLocks",
    "repairable",
]
