"""Rollback: the rules that make a version committed before the default again.

A rollback is a publication of an old version's exact content and identity (same version id,
digest and lora name: the same ``(epoch, version_id)`` always means the same bytes), two-phase
like any other: the default moves only in one atomic step that finds every engine READY for the
version's current attempt and incarnation (the commit's own rule,
:meth:`~agentic_lora.registry.state.RegistryState._move_default`). Two ways, by the version's
state (see :mod:`~agentic_lora.registry.transitions`):

* **RETIRED**: still loaded (a repair puts it back on a restarted engine). :func:`rollback` moves
  the default to it (``rollback``: RETIRED -> PUBLISHED); the current default is superseded.
  No capacity slot changes hands: it held its slot all along.
* **RECLAIMED**: unloaded everywhere. :func:`reserve_rollback` admits a slot before any transfer
  and starts a new attempt (``reload``: RECLAIMED -> LOADING, attempt + 1); the version is
  prepared on every engine and recorded READY as in any publication, and ``commit`` of that
  attempt is the rollback. Aborted and cleaned, the attempt leaves it RECLAIMED again.

Every move of the default increments ``default_revision``, a rollback's too; while the default is
one a rollback brought back, ``rolled_back_from`` names the version it replaced (the status, the
commit receipt and every Session bound meanwhile carry it). A replayed rollback returns the same
receipt: with its request id from the registry's memory, and with a new one too while the
version is still the default that rollback made it.

Refusals, each typed: the current default (``ROLLBACK_REFUSED``, ``current_default``), a version
never committed (``never_committed``: LOADING for the first time, FAILED_CLEAN), an ABORTED one
(``aborted``), another publication pending (``PUBLICATION_BLOCKED``), an unknown version
(``UNKNOWN_VERSION``), a state the table has no edge from (``INVALID_STATE``: RECLAIMING; a
RETIRED version for ``reserve_rollback``, a RECLAIMED one for ``rollback``), the default moved
meanwhile (``REVISION_CONFLICT``), an engine not READY (``NOT_READY``), no free slot for a reload
(``CAPACITY_ERROR``).
"""

from __future__ import annotations

import dataclasses

from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import RollbackRefusedError
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import VersionRecord
from agentic_lora.registry.transitions import VersionEvent
from agentic_lora.registry.transitions import advance
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.views import reservation

__all__ = ["reserve_rollback", "rollback"]


def reserve_rollback(state: RegistryState, version_id: str) -> Reservation:
    """Start loading a RECLAIMED version again for a rollback (a slot is admitted first)."""
    v = state._version(version_id)
    _refuse_unless_rollable(state, v)
    if v.state is VersionState.LOADING:
        return reservation(state, v, ReserveOutcome.IN_PROGRESS)  # its reload is running
    if v.state is not VersionState.RECLAIMED:
        advance(version_id, v.state, VersionEvent.RELOAD)  # raises InvalidStateError
    state._admit(version_id)
    v.state = advance(version_id, v.state, VersionEvent.RELOAD)
    # A new attempt of the same content: the engines' fences and the registry's stale-attempt
    # checks tell it apart from everything the reclaimed attempt left behind.
    v.ref = dataclasses.replace(v.ref, attempt=v.attempt + 1)
    v.ready.clear()
    v.cleaned.clear()
    v.reclaimed.clear()
    v.reclaim_id = None
    v.reloads += 1
    state._pending = version_id
    return reservation(state, v, ReserveOutcome.RELOAD_STARTED)


def rollback(
    state: RegistryState, version_id: str, attempt: int, expected_default_revision: int
) -> CommitReceipt:
    """Make a RETIRED version the default again, if every engine holds ``attempt`` now."""
    v = state._version(version_id)
    receipt = v.commit_receipt
    if (
        receipt is not None
        and receipt.rollback
        and receipt.attempt == attempt
        and state.default_version == version_id
    ):
        return receipt  # a replayed rollback: the same receipt, nothing moves
    _refuse_unless_rollable(state, v)
    if v.state is not VersionState.RETIRED:
        advance(version_id, v.state, VersionEvent.ROLLBACK)  # raises InvalidStateError
    return state._move_default(v, attempt, expected_default_revision, VersionEvent.ROLLBACK)


def _refuse_unless_rollable(state: RegistryState, v: VersionRecord) -> None:
    """The refusals every rollback shares (see the module docstring)."""
    version_id = v.version_id
    if v.state is VersionState.ABORTED:
        raise RollbackRefusedError(
            f"attempt {v.attempt} of {version_id!r} is aborted and its cleanup is not confirmed; "
            "resolve it first",
            version=version_id,
            reason="aborted",
            attempt=v.attempt,
        )
    if not v.committed_before:
        raise RollbackRefusedError(
            f"{version_id!r} was never the default ({v.state.value}); there is nothing to roll "
            "back to",
            version=version_id,
            reason="never_committed",
            state=v.state.value,
        )
    if state.default_version == version_id:
        raise RollbackRefusedError(
            f"{version_id!r} is the default already", version=version_id, reason="current_default"
        )
    if state._pending is not None and state._pending != version_id:
        raise PublicationBlockedError(
            f"publication of {state._pending!r} is still pending; one at a time",
            version=version_id,
            pending=state._pending,
        )
