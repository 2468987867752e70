"""Engine incarnations: what an engine restart voids in the registry's state.

Each engine process has an incarnation (read from the engine by the front end). A new incarnation
is a new process that holds no adapter at all, so everything recorded against the old one is void,
in whichever direction that cuts: READY receipts no longer count (a commit must wait for fresh
ones, and no request may be routed there until a repair loads the version again), while an
aborted or reclaiming version's cleanup on that engine is proven by the restart itself.
"""

from __future__ import annotations

from agentic_lora.errors import EngineRestartedError
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import VersionRecord
from agentic_lora.registry.state import check_token
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import VersionState

__all__ = ["check_current_incarnation", "observe_incarnation"]


def observe_incarnation(state: RegistryState, engine: str, incarnation: str) -> bool:
    state._engine(engine)
    check_token(incarnation, "incarnation")
    known = state._incarnations[engine]
    if known == incarnation:
        return False
    state._incarnations[engine] = incarnation
    if known is None:
        return True  # the first sighting: nothing was recorded against an older process
    # A new incarnation is a new process: it holds no adapter at all. Everything recorded
    # against the old one is void, in whichever direction that cuts.
    for v in state._versions.values():
        if v.state is VersionState.LOADING or v.state.dispatchable:
            # LOADING: its READY no longer proves anything, commit must wait for a fresh
            # one. PUBLISHED/RETIRED: the engine no longer holds it, so no request for it may
            # be routed there until it is loaded again (repair) and its READY recorded.
            r = v.ready.get(engine)
            if r is not None and r.incarnation != incarnation:
                del v.ready[engine]
        elif v.state is VersionState.ABORTED:
            # The restart is the proof of cleanup the aborted attempt was waiting for.
            state._cleaned(v, engine)
        elif v.state is VersionState.RECLAIMING:
            # Nothing loads a RECLAIMING version again (repair refuses it), so the restarted
            # engine provably holds nothing of it.
            state._reclaimed(v, engine)
    return True


def check_current_incarnation(
    state: RegistryState, v: VersionRecord, receipt: ReadyReceipt
) -> None:
    """Refuse a READY from an engine process that is no longer the current one (the first
    incarnation seen for an engine becomes its current one)."""
    known = state._incarnations[receipt.engine]
    if known is None:
        state._incarnations[receipt.engine] = receipt.incarnation
    elif known != receipt.incarnation:
        raise EngineRestartedError(
            f"READY from {receipt.engine} incarnation {receipt.incarnation!r}, "
            f"but the engine is now {known!r}",
            version=v.version_id,
            engine=receipt.engine,
            incarnation=receipt.incarnation,
            current_incarnation=known,
        )
