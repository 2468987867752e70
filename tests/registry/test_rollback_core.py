"""Rollback in the registry core: a version committed before becomes the default again, two-phase,
with its exact identity; every illegal case is a typed refusal that changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import CapacityError
from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import NotReadyError
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import RevisionConflictError
from agentic_lora.errors import RollbackRefusedError
from agentic_lora.errors import StaleAttemptError
from agentic_lora.errors import UnknownVersionError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.transitions import TRANSITIONS
from agentic_lora.registry.transitions import VersionEvent
from agentic_lora.registry.transitions import advance
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.publish import publish_by_verbs

from .util import E0
from .util import E1
from .util import bind
from .util import call
from .util import close
from .util import digest_of
from .util import new_core
from .util import publish
from .util import ready
from .util import reclaim
from .util import registry_image

S = VersionState


def roll_back(core: RegistryCore, version_id: str, request_id: str | None = None) -> CommitReceipt:
    """The rollback verb against the current revision, for the version's current attempt."""
    receipt: CommitReceipt = call(
        core,
        "rollback",
        request_id,
        version_id=version_id,
        attempt=core.version(version_id).attempt,
        expected_default_revision=core.default_revision,
    )
    return receipt


def refused(core: RegistryCore, verb: str, **args: Any) -> AgenticLoRAError:
    """``verb`` is refused with a typed error and changes nothing at all."""
    before = registry_image(core)
    with pytest.raises(AgenticLoRAError) as err:
        call(core, verb, **args)
    assert registry_image(core) == before
    return err.value


def a_then_b(capacity: int = 2) -> RegistryCore:
    """A published, a Session bound on it, B published: A is RETIRED and held."""
    core = new_core(capacity, published="A")
    assert bind(core, "on-a") == "A"
    publish(core, "B")
    assert bind(core, "on-b") == "B"
    return core


def test_a_rollback_to_a_retired_version_moves_the_default_and_says_where_from() -> None:
    core = a_then_b()
    a_before = core.version("A")
    receipt = roll_back(core, "A")
    assert receipt.ref == a_before.ref  # the exact identity: id, digest, lora name, attempt
    assert (receipt.default_revision, receipt.previous_default, receipt.rollback) == (3, "B", True)
    status = core.status()
    assert (status.default_version, status.default_revision) == ("A", 3)
    assert status.rolled_back_from == "B"
    assert (core.state_of("A"), core.state_of("B")) == (S.PUBLISHED, S.RETIRED)
    assert status.slots_in_use == 2  # nothing loaded, nothing freed: both held their slot
    # Sessions keep what they bound; a new one binds the rolled-back version and can tell.
    assert core.session("on-b").version_id == "B"  # type: ignore[union-attr]
    fresh = call(core, "bind_first", session_key="after")
    assert (fresh.version_id, fresh.default_revision, fresh.rolled_back_from) == ("A", 3, "B")
    assert call(core, "bind_first", session_key="on-b").version_id == "B"
    # The newer version is retired like any superseded default, and reclaimed once unheld.
    close(core, "on-b")
    reclaim(core, "B")
    assert core.state_of("B") is S.RECLAIMED


def test_a_publication_after_a_rollback_ends_the_rollback_provenance() -> None:
    core = a_then_b(capacity=3)
    roll_back(core, "A")
    publish(core, "C")
    status = core.status()
    assert (status.default_version, status.rolled_back_from) == ("C", None)
    assert call(core, "bind_first", session_key="later").rolled_back_from is None


def test_a_replayed_rollback_returns_the_same_receipt_and_moves_nothing() -> None:
    core = a_then_b()
    first = roll_back(core, "A", request_id="rb-1")
    assert call(core, "rollback", "rb-1", **_rollback_args(core, "A", revision=2)) == first
    # A new request id, while A is still the default that rollback made it: the same receipt.
    assert roll_back(core, "A") == first
    assert core.default_revision == 3


def _rollback_args(core: RegistryCore, version_id: str, *, revision: int) -> dict[str, Any]:
    return {
        "version_id": version_id,
        "attempt": core.version(version_id).attempt,
        "expected_default_revision": revision,
    }


def test_a_second_rollback_to_the_same_version_after_a_publication_is_a_new_one() -> None:
    core = a_then_b(capacity=3)
    first = roll_back(core, "A")
    publish(core, "C")
    second = roll_back(core, "A")
    assert (second.default_revision, second.previous_default) == (5, "C")
    assert second != first
    assert core.status().rolled_back_from == "C"


def test_rollback_refusals_are_typed_and_change_nothing() -> None:
    core = a_then_b()
    err = refused(core, "rollback", **_rollback_args(core, "B", revision=2))
    assert isinstance(err, RollbackRefusedError)
    assert err.details == {"version": "B", "reason": "current_default"}
    assert isinstance(
        refused(core, "rollback", version_id="nope", attempt=1, expected_default_revision=2),
        UnknownVersionError,
    )
    # The default moved meanwhile, and a stale attempt.
    assert isinstance(
        refused(core, "rollback", **_rollback_args(core, "A", revision=1)), RevisionConflictError
    )
    assert isinstance(
        refused(core, "rollback", version_id="A", attempt=2, expected_default_revision=2),
        StaleAttemptError,
    )


def test_a_rollback_to_a_version_never_committed_or_aborted_is_refused() -> None:
    core = new_core(3, published="A")
    r = call(core, "reserve", version_id="B", digest=digest_of("B"))  # LOADING, never committed
    err = refused(core, "rollback", version_id="B", attempt=1, expected_default_revision=1)
    assert (err.code, err.details["reason"]) == ("ROLLBACK_REFUSED", "never_committed")
    err = refused(core, "reserve_rollback", version_id="B")
    assert (err.code, err.details["reason"]) == ("ROLLBACK_REFUSED", "never_committed")
    call(core, "abort", version_id="B", attempt=r.attempt, reason="test")
    err = refused(core, "rollback", version_id="B", attempt=1, expected_default_revision=1)
    assert (err.code, err.details["reason"]) == ("ROLLBACK_REFUSED", "aborted")
    for engine in (E0, E1):
        call(core, "confirm_cleanup", version_id="B", attempt=1, engine=engine)
    assert core.state_of("B") is S.FAILED_CLEAN
    err = refused(core, "reserve_rollback", version_id="B")
    assert (err.code, err.details["reason"]) == ("ROLLBACK_REFUSED", "never_committed")


def test_a_rollback_waits_for_a_pending_publication_and_a_running_reclaim() -> None:
    core = a_then_b(capacity=3)
    call(core, "reserve", version_id="C", digest=digest_of("C"))
    err = refused(core, "rollback", **_rollback_args(core, "A", revision=2))
    assert isinstance(err, PublicationBlockedError)
    assert err.details["pending"] == "C"
    core = a_then_b()
    close(core, "on-a")
    call(core, "claim_reclaim", version_id="A")
    for verb in ("rollback", "reserve_rollback"):
        args = _rollback_args(core, "A", revision=2) if verb == "rollback" else {"version_id": "A"}
        err = refused(core, verb, **args)
        assert isinstance(err, InvalidStateError)
        assert (err.details["state"], err.details["event"]) == (
            "RECLAIMING",
            "rollback" if verb == "rollback" else "reload",
        )


def test_the_default_moves_only_with_every_engine_ready_on_its_current_incarnation() -> None:
    core = a_then_b()
    call(core, "observe_incarnation", engine=E1, incarnation="inc-2")  # E1 restarted: holds nothing
    err = refused(core, "rollback", **_rollback_args(core, "A", revision=2))
    assert isinstance(err, NotReadyError)
    assert err.details["missing"] == [E1]
    # Loaded again (a repair, or the rollback's own prepare): the committed attempt's READY.
    a = core.version("A")
    call(core, "record_ready", receipt=_receipt(a.ref, E1, "inc-2"))
    assert roll_back(core, "A").rollback


def _receipt(ref: VersionRef, engine: str, incarnation: str) -> ReadyReceipt:
    return ReadyReceipt(engine, ref, incarnation)


def reclaimed_a() -> RegistryCore:
    """A was the default, then B; A's Session closed and A was reclaimed everywhere."""
    core = a_then_b()
    close(core, "on-a")
    reclaim(core, "A")
    assert core.state_of("A") is S.RECLAIMED
    return core


def test_a_rollback_to_a_reclaimed_version_reloads_it_as_a_new_attempt_of_the_same_content() -> (
    None
):
    core = reclaimed_a()
    before = core.version("A")
    err = refused(core, "rollback", version_id="A", attempt=1, expected_default_revision=2)
    assert (err.code, err.details["state"]) == ("INVALID_STATE", "RECLAIMED")
    r: Reservation = call(core, "reserve_rollback", version_id="A")
    assert r.outcome is ReserveOutcome.RELOAD_STARTED
    assert r.ref == VersionRef(before.version_id, before.digest, before.lora_name, 2)
    status = core.status()
    assert (status.pending_version, status.slots_in_use) == ("A", 2)
    # A replay of the reserve joins it; a publication of the same id never does.
    assert call(core, "reserve_rollback", version_id="A").outcome is ReserveOutcome.IN_PROGRESS
    err = refused(core, "reserve", version_id="A", digest=before.digest)
    assert isinstance(err, PublicationBlockedError)
    # READY of the reclaimed attempt is stale; the new attempt's is what counts.
    err = refused(core, "record_ready", receipt=_receipt(before.ref, E0, "inc-1"))
    assert isinstance(err, StaleAttemptError)
    ready(core, r)
    receipt = call(core, "commit", version_id="A", attempt=2, expected_default_revision=2)
    assert (receipt.rollback, receipt.previous_default, receipt.default_revision) == (
        True,
        "B",
        3,
    )
    assert core.status().rolled_back_from == "B"
    assert (core.state_of("A"), core.state_of("B")) == (S.PUBLISHED, S.RETIRED)
    # Reclaimed again later: under a new reclaim id (a backend confirms one reclaim per id).
    close(core, "on-b")  # B must go first: capacity 2
    reclaim(core, "B")
    publish(core, "C")
    claim = call(core, "claim_reclaim", version_id="A")
    assert (claim.reclaim_id, claim.attempt) == ("reclaim-0-A.1", 2)


def test_a_reload_is_admitted_before_any_transfer_and_refused_beyond_capacity() -> None:
    core = reclaimed_a()
    call(core, "reserve", version_id="C", digest=digest_of("C"))
    ready(core, call(core, "reserve", version_id="C", digest=digest_of("C")))
    call(core, "commit", version_id="C", attempt=1, expected_default_revision=2)
    # B is RETIRED and still held by on-b, C is the default: both slots are held.
    err = refused(core, "reserve_rollback", version_id="A")
    assert isinstance(err, CapacityError)


def test_an_aborted_reload_is_reclaimed_again_never_failed_clean() -> None:
    core = reclaimed_a()
    r = call(core, "reserve_rollback", version_id="A")
    call(core, "abort", version_id="A", attempt=r.attempt, reason="prepare failed")
    err = refused(core, "reserve_rollback", version_id="A")
    assert (err.code, err.details["reason"]) == ("ROLLBACK_REFUSED", "aborted")
    call(core, "confirm_cleanup", version_id="A", attempt=r.attempt, engine=E0)
    call(core, "observe_incarnation", engine=E1, incarnation="inc-9")  # a restart is a cleanup
    a = core.version("A")
    assert (a.state, core.status().pending_version) == (S.RECLAIMED, None)
    # Publishing the same id stays a no-op; a rollback may try again, as the next attempt.
    again = call(core, "reserve", version_id="A", digest=a.digest)
    assert again.outcome is ReserveOutcome.ALREADY_COMPLETED
    retry = call(core, "reserve_rollback", version_id="A")
    assert (retry.outcome, retry.attempt) == (ReserveOutcome.RELOAD_STARTED, 3)


def test_a_claim_of_a_version_whose_reload_was_cleaned_is_settled() -> None:
    # Found by the state machine: a reclaimer claiming a version RECLAIMED again by its aborted
    # reload's cleanup got no reclaim id (the reload had cleared it). The cleanup was the
    # reclaim: the claim comes back with the reload's own id, every engine confirmed.
    core = reclaimed_a()
    r = call(core, "reserve_rollback", version_id="A")
    call(core, "abort", version_id="A", attempt=r.attempt, reason="prepare failed")
    for engine in (E0, E1):
        call(core, "confirm_cleanup", version_id="A", attempt=r.attempt, engine=engine)
    assert core.state_of("A") is S.RECLAIMED
    claim = call(core, "claim_reclaim", version_id="A")
    assert (claim.reclaim_id, claim.attempt, claim.confirmed) == ("reclaim-0-A.1", 2, (E0, E1))
    copy = RegistryCore(engines=(E0, E1), capacity=2)
    copy.load_state(core.to_state())
    assert call(copy, "claim_reclaim", version_id="A") == claim


def test_the_transition_table_has_the_rollback_edges_and_refuses_the_rest() -> None:
    assert TRANSITIONS[(S.RETIRED, VersionEvent.ROLLBACK)] is S.PUBLISHED
    assert TRANSITIONS[(S.RECLAIMED, VersionEvent.RELOAD)] is S.LOADING
    assert TRANSITIONS[(S.ABORTED, VersionEvent.RELOAD_CLEANED)] is S.RECLAIMED
    for state in S:
        for event in (VersionEvent.ROLLBACK, VersionEvent.RELOAD, VersionEvent.RELOAD_CLEANED):
            if (state, event) in TRANSITIONS:
                continue
            with pytest.raises(InvalidStateError) as err:
                advance("v", state, event)
            assert err.value.details["event"] == event.value


def test_the_snapshot_keeps_the_rollback_and_reads_images_from_before_rollbacks() -> None:
    core = reclaimed_a()
    r = call(core, "reserve_rollback", version_id="A")
    ready(core, r)
    call(core, "commit", version_id="A", attempt=2, expected_default_revision=2)
    image = core.to_state()
    copy = RegistryCore(engines=(E0, E1), capacity=2)
    copy.load_state(image)
    assert registry_image(copy) == registry_image(core)
    assert copy.status().rolled_back_from == "B"
    old = new_core(published="A").to_state()
    del old["rolled_back_from"]
    for raw in old["versions"]:
        del raw["reloads"]
    loaded = RegistryCore(engines=(E0, E1), capacity=2)
    loaded.load_state(old)
    assert loaded.status().rolled_back_from is None


@pytest.mark.asyncio
async def test_a_journal_replays_rollbacks_exactly(tmp_path: Path) -> None:
    def open_registry() -> LocalRegistry:
        return LocalRegistry(engines=(E0, E1), capacity=2, journal_path=tmp_path / "j.sqlite")

    reg = open_registry()
    rid = new_request_id
    await publish_by_verbs(reg, "A", (E0, E1))
    await publish_by_verbs(reg, "B", (E0, E1))
    receipt = await reg.rollback(
        request_id="rb", version_id="A", attempt=1, expected_default_revision=2
    )
    claim = await reg.claim_reclaim(request_id=rid(), version_id="B")
    for e in (E0, E1):
        await reg.confirm_reclaim(
            request_id=rid(), version_id="B", reclaim_id=claim.reclaim_id, engine=e
        )
    reload = await reg.reserve_rollback(request_id="rr", version_id="B")
    image = registry_image(reg.core)
    await reg.aclose()
    reg = open_registry()
    try:
        assert registry_image(reg.core) == image
        # A replay after the restart gets the original answers.
        again = await reg.rollback(
            request_id="rb", version_id="A", attempt=1, expected_default_revision=2
        )
        assert again == receipt
        assert await reg.reserve_rollback(request_id="rr", version_id="B") == reload
    finally:
        await reg.aclose()
