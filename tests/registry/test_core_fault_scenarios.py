"""One named test per fault scenario the registry owns (rules 3.4, 5.2 and 7.1),
plus the registry's own contracts (idempotency, typed errors). All against the real core."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from agentic_lora.errors import CapacityError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import NoPublishedVersionError
from agentic_lora.errors import NotReadyError
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import ReadyMismatchError
from agentic_lora.errors import RevisionConflictError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionStillBoundError
from agentic_lora.errors import StaleAttemptError
from agentic_lora.errors import UnknownEngineError
from agentic_lora.errors import UnknownVersionError
from agentic_lora.errors import VersionConflictError
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import VersionState

from .util import E0
from .util import E1
from .util import bind
from .util import call
from .util import close
from .util import digest_of
from .util import new_core
from .util import publish
from .util import ready
from .util import receipt
from .util import reclaim


def test_split_fleet_ready_keeps_default_until_every_engine_is_ready() -> None:
    core = new_core(published="A")
    assert bind(core, "S_old") == "A"
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb, E0)
    # E1 not ready: the default is still A, a Session binding now gets A.
    assert core.default_version == "A"
    assert bind(core, "S_mid") == "A"
    with pytest.raises(NotReadyError) as err:
        call(core, "commit", version_id="B", attempt=rb.attempt, expected_default_revision=1)
    assert err.value.details["missing"] == [E1]
    ready(core, rb, E1)
    receipt_b = call(
        core, "commit", version_id="B", attempt=rb.attempt, expected_default_revision=1
    )
    assert receipt_b.previous_default == "A"
    assert receipt_b.default_revision == 2
    assert bind(core, "S_new") == "B"
    # Every later turn of the old Sessions returns their first answer.
    assert bind(core, "S_old") == "A"
    assert bind(core, "S_mid") == "A"
    assert core.version("A").state is VersionState.RETIRED
    assert core.version("A").session_refs == 2
    assert core.version("B").state is VersionState.PUBLISHED


def test_duplicate_publication_with_same_content_is_a_no_op() -> None:
    core = new_core()
    r1 = call(core, "reserve", version_id="A", digest=digest_of("A"))
    r2 = call(core, "reserve", version_id="A", digest=digest_of("A"))
    assert r1.outcome is ReserveOutcome.STARTED
    assert r2.outcome is ReserveOutcome.IN_PROGRESS
    assert r2.attempt == r1.attempt
    assert core.status().slots_in_use == 1
    ready(core, r1)
    first = call(core, "commit", version_id="A", attempt=1, expected_default_revision=0)
    again = call(core, "reserve", version_id="A", digest=digest_of("A"))
    assert again.outcome is ReserveOutcome.ALREADY_COMPLETED
    assert core.status().slots_in_use == 1
    # A retried commit (its reply was lost) returns the same receipt; the default does not move.
    assert call(core, "commit", version_id="A", attempt=1, expected_default_revision=0) == first
    assert core.default_revision == 1


def test_completed_publication_replayed_late_never_rolls_default_back() -> None:
    core = new_core()
    ra = publish(core, "A")
    publish(core, "B")
    reclaim(core, "A")
    assert core.version("A").state is VersionState.RECLAIMED
    late = call(core, "commit", version_id="A", attempt=ra.attempt, expected_default_revision=0)
    assert late.default_revision == 1  # the original receipt
    assert core.default_version == "B"
    replay = call(core, "reserve", version_id="A", digest=digest_of("A"))
    assert replay.outcome is ReserveOutcome.ALREADY_COMPLETED
    assert core.version("A").state is VersionState.RECLAIMED
    assert core.status().slots_in_use == 1


@pytest.mark.parametrize(
    "state",
    ["LOADING", "PUBLISHED", "RETIRED", "RECLAIMING", "RECLAIMED", "ABORTED", "FAILED_CLEAN"],
)
def test_same_id_with_different_content_conflicts_in_every_state(state: str) -> None:
    core = new_core(capacity=3)
    if state in ("LOADING", "ABORTED", "FAILED_CLEAN"):
        publish(core, "base")
        r = call(core, "reserve", version_id="X", digest=digest_of("X"))
        if state in ("ABORTED", "FAILED_CLEAN"):
            call(core, "abort", version_id="X", attempt=r.attempt, reason="test")
        if state == "FAILED_CLEAN":
            for e in (E0, E1):
                call(core, "confirm_cleanup", version_id="X", attempt=r.attempt, engine=e)
    else:
        publish(core, "X")
        if state != "PUBLISHED":
            publish(core, "Y")
        if state == "RECLAIMING":
            call(core, "claim_reclaim", version_id="X")
        if state == "RECLAIMED":
            reclaim(core, "X")
    assert core.version("X").state.value == state
    before = core.status()
    with pytest.raises(VersionConflictError) as err:
        call(core, "reserve", version_id="X", digest=digest_of("other"))
    assert err.value.code == "VERSION_CONFLICT"
    assert err.value.details["state"] == state
    assert core.status() == before


def test_new_id_with_historical_content_is_a_new_publication() -> None:
    core = new_core()
    publish(core, "v1", content="A")
    publish(core, "v2", content="B")
    reclaim(core, "v1")
    r3 = call(core, "reserve", version_id="v3", digest=digest_of("A"))
    assert r3.outcome is ReserveOutcome.STARTED
    assert r3.lora_name != core.version("v1").lora_name
    ready(core, r3)
    call(core, "commit", version_id="v3", attempt=1, expected_default_revision=2)
    assert core.default_version == "v3"
    assert bind(core, "s") == "v3"


def test_failed_candidate_frees_its_slot_only_after_every_cleanup_is_confirmed() -> None:
    core = new_core(published="A")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb, E0)
    call(core, "abort", version_id="B", attempt=1, reason="E1 refused")
    assert core.default_version == "A"
    assert core.status().slots_in_use == 2
    with pytest.raises(PublicationBlockedError):
        call(core, "reserve", version_id="C", digest=digest_of("C"))
    call(core, "confirm_cleanup", version_id="B", attempt=1, engine=E0)
    assert core.version("B").state is VersionState.ABORTED
    assert core.status().slots_in_use == 2
    call(core, "confirm_cleanup", version_id="B", attempt=1, engine=E1)
    assert core.version("B").state is VersionState.FAILED_CLEAN
    assert core.status().slots_in_use == 1
    assert core.status().pending_version is None
    assert core.default_version == "A"
    # The same id and content may try again with a new attempt; old-attempt messages are fenced.
    retry = call(core, "reserve", version_id="B", digest=digest_of("B"))
    assert retry.outcome is ReserveOutcome.RETRY_STARTED
    assert retry.attempt == 2
    with pytest.raises(StaleAttemptError):
        call(core, "record_ready", receipt=receipt(core, rb, E0))
    with pytest.raises(StaleAttemptError):
        call(core, "confirm_cleanup", version_id="B", attempt=1, engine=E0)
    with pytest.raises(StaleAttemptError):
        call(core, "commit", version_id="B", attempt=1, expected_default_revision=1)
    ready(core, retry)
    call(core, "commit", version_id="B", attempt=2, expected_default_revision=1)
    assert core.default_version == "B"


def test_unconfirmed_cleanup_keeps_the_slot_and_blocks_publication() -> None:
    core = new_core(capacity=3)
    publish(core, "A")
    call(core, "reserve", version_id="B", digest=digest_of("B"))
    call(core, "abort", version_id="B", attempt=1, reason="ambiguous")
    call(core, "confirm_cleanup", version_id="B", attempt=1, engine=E0)
    with pytest.raises(PublicationBlockedError):
        call(core, "reserve", version_id="C", digest=digest_of("C"))
    with pytest.raises(PublicationBlockedError):
        call(core, "reserve", version_id="B", digest=digest_of("B"))
    assert core.status().slots_in_use == 2


def test_lost_commit_reply_is_answered_by_a_replay_with_the_same_request_id() -> None:
    core = new_core(published="A")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb)
    first, applied = core.execute(
        "commit-1", "commit", {"version_id": "B", "attempt": 1, "expected_default_revision": 1}
    )
    assert applied
    replay, applied_again = core.execute(
        "commit-1", "commit", {"version_id": "B", "attempt": 1, "expected_default_revision": 1}
    )
    assert not applied_again
    assert replay == first
    assert core.default_revision == 2


def test_engine_restart_invalidates_its_ready_for_the_pending_version() -> None:
    core = new_core(published="A")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb)
    assert call(core, "observe_incarnation", engine=E1, incarnation="inc-2") is True
    assert call(core, "observe_incarnation", engine=E1, incarnation="inc-2") is False
    assert core.version("B").ready_engines == (E0,)
    with pytest.raises(NotReadyError):
        call(core, "commit", version_id="B", attempt=1, expected_default_revision=1)
    # A READY from the old incarnation arriving late is refused.
    with pytest.raises(EngineRestartedError):
        call(core, "record_ready", receipt=receipt(core, rb, E1, incarnation="inc-1"))
    call(core, "record_ready", receipt=receipt(core, rb, E1, incarnation="inc-2"))
    call(core, "commit", version_id="B", attempt=1, expected_default_revision=1)
    assert core.default_version == "B"


def test_ready_receipt_for_other_content_is_refused() -> None:
    core = new_core()
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    bad = receipt(core, rb, E0)
    with pytest.raises(ReadyMismatchError):
        call(core, "record_ready", receipt=_naming(bad, digest=digest_of("Z")))
    with pytest.raises(ReadyMismatchError):
        call(core, "record_ready", receipt=_naming(bad, lora_name="x@0-B-0"))
    with pytest.raises(UnknownEngineError):
        call(core, "record_ready", receipt=dataclasses.replace(bad, engine="e9"))
    with pytest.raises(UnknownVersionError):
        call(core, "record_ready", receipt=_naming(bad, version_id="nope"))


def _naming(receipt: ReadyReceipt, **ref_parts: Any) -> ReadyReceipt:
    """``receipt`` with its ref's ``ref_parts`` changed (a READY that names other content)."""
    return dataclasses.replace(receipt, ref=dataclasses.replace(receipt.ref, **ref_parts))


def test_commit_against_a_moved_default_revision_is_refused() -> None:
    core = new_core(published="A")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb)
    with pytest.raises(RevisionConflictError):
        call(core, "commit", version_id="B", attempt=1, expected_default_revision=0)
    assert core.default_version == "A"


def _refuses_a_bind(core: RegistryCore, session: str) -> None:
    """A Session that began to close never binds again, whatever its closing has reached."""
    with pytest.raises(SessionClosedError):
        call(core, "bind_first", session_key=session)


def test_one_session_binds_once_and_holds_one_ref() -> None:
    core = new_core(published="A")
    first = call(core, "bind_first", session_key="s")
    for _ in range(5):
        assert call(core, "bind_first", session_key="s") == first
    assert core.version("A").session_refs == 1


def test_close_before_bind_refuses_a_late_bind_and_releases_nothing() -> None:
    core = new_core(published="A")
    status = call(core, "begin_close", session_key="s")
    assert status.state is SessionState.CLOSING
    assert status.version_id is None
    _refuses_a_bind(core, "s")
    released = call(core, "release", session_key="s")
    assert released.version_id is None
    assert released.released_now
    assert core.version("A").session_refs == 0
    _refuses_a_bind(core, "s")


def test_duplicate_close_and_release_drop_the_ref_exactly_once() -> None:
    core = new_core(published="A")
    bind(core, "s1")
    bind(core, "s2")
    call(core, "begin_close", session_key="s1")
    call(core, "begin_close", session_key="s1")
    assert call(core, "release", session_key="s1").released_now
    assert not call(core, "release", session_key="s1").released_now
    assert not call(core, "release", session_key="s1").released_now
    assert core.version("A").session_refs == 1
    _refuses_a_bind(core, "s1")


def test_release_needs_begin_close_first() -> None:
    core = new_core(published="A")
    bind(core, "s")
    with pytest.raises(InvalidStateError):
        call(core, "release", session_key="s")
    with pytest.raises(InvalidStateError):
        call(core, "release", session_key="never-seen")


def test_bind_before_first_publication_is_refused() -> None:
    core = new_core()
    with pytest.raises(NoPublishedVersionError) as err:
        call(core, "bind_first", session_key="s")
    assert err.value.code == "NO_PUBLISHED_VERSION"
    # Nothing was recorded: the same request id binds once a version exists.
    publish(core, "A")
    result, applied = core.execute("bind-1", "bind_first", {"session_key": "s"})
    assert applied
    assert result.version_id == "A"


def test_capacity_refusal_happens_before_any_transfer_and_clears_after_reclaim() -> None:
    core = new_core(capacity=2)
    publish(core, "A")
    bind(core, "s_old")
    publish(core, "B")
    with pytest.raises(CapacityError) as err:
        call(core, "reserve", version_id="C", digest=digest_of("C"))
    assert sorted(err.value.details["held"]) == ["A", "B"]
    assert core.peek_version("C") is None
    with pytest.raises(SessionStillBoundError):
        call(core, "claim_reclaim", version_id="A")
    close(core, "s_old")
    claim = call(core, "claim_reclaim", version_id="A")
    assert core.version("A").state is VersionState.RECLAIMING
    call(core, "confirm_reclaim", version_id="A", reclaim_id=claim.reclaim_id, engine=E0)
    # One engine confirmed: the slot is still held.
    with pytest.raises(CapacityError):
        call(core, "reserve", version_id="C", digest=digest_of("C"))
    call(core, "confirm_reclaim", version_id="A", reclaim_id=claim.reclaim_id, engine=E1)
    assert core.version("A").state is VersionState.RECLAIMED
    rc = call(core, "reserve", version_id="C", digest=digest_of("C"))
    assert rc.outcome is ReserveOutcome.STARTED
    assert core.default_version == "B"


def test_repeated_reclaim_and_late_unload_receipts_are_idempotent() -> None:
    core = new_core(published="A")
    publish(core, "B")
    c1 = call(core, "claim_reclaim", version_id="A")
    c2 = call(core, "claim_reclaim", version_id="A")
    assert c1.reclaim_id == c2.reclaim_id
    call(core, "confirm_reclaim", version_id="A", reclaim_id=c1.reclaim_id, engine=E0)
    call(core, "confirm_reclaim", version_id="A", reclaim_id=c1.reclaim_id, engine=E0)
    assert core.version("A").reclaimed_engines == (E0,)
    call(core, "confirm_reclaim", version_id="A", reclaim_id=c1.reclaim_id, engine=E1)
    late = call(core, "confirm_reclaim", version_id="A", reclaim_id=c1.reclaim_id, engine=E1)
    assert late.state is VersionState.RECLAIMED
    assert call(core, "claim_reclaim", version_id="A").confirmed == (E0, E1)
    with pytest.raises(StaleAttemptError):
        call(core, "confirm_reclaim", version_id="A", reclaim_id="reclaim-other", engine=E0)


def test_the_default_and_pending_versions_cannot_be_reclaimed() -> None:
    core = new_core(published="A")
    with pytest.raises(InvalidStateError):
        call(core, "claim_reclaim", version_id="A")
    call(core, "reserve", version_id="B", digest=digest_of("B"))
    with pytest.raises(InvalidStateError):
        call(core, "claim_reclaim", version_id="B")
    with pytest.raises(StaleAttemptError):
        call(core, "confirm_reclaim", version_id="B", reclaim_id="reclaim-0-B", engine=E0)


def test_forget_sessions_drops_tombstones_but_never_a_live_session() -> None:
    core = new_core(published="A")
    bind(core, "live")
    bind(core, "done")
    close(core, "done")
    with pytest.raises(SessionStillBoundError):
        call(core, "forget_sessions", session_keys=["done", "live"])
    assert core.session("done") is not None  # the refused batch changed nothing
    assert call(core, "forget_sessions", session_keys=["done", "unknown"]) == 1
    assert core.session("done") is None
    assert core.session_count == 1


def test_a_request_id_reused_for_another_call_is_refused() -> None:
    core = new_core(published="A")
    core.execute("rid", "bind_first", {"session_key": "s1"})
    with pytest.raises(InvalidStateError) as err:
        core.execute("rid", "bind_first", {"session_key": "s2"})
    assert err.value.details["reason"] == "request_id_reused"
    with pytest.raises(InvalidStateError):
        core.execute("", "bind_first", {"session_key": "s2"})
    with pytest.raises(InvalidStateError):
        core.execute("rid-2", "no_such_verb", {})


def test_idempotency_memory_is_bounded() -> None:
    core = new_core(idempotency_window=8)
    publish(core, "A")
    for i in range(100):
        core.execute(f"b{i}", "bind_first", {"session_key": f"s{i}"})
    assert len(core._done) == 8


def test_bad_input_gets_typed_errors() -> None:
    core = new_core()
    with pytest.raises(ReadyMismatchError):
        call(core, "reserve", version_id="A", digest="not-a-digest")
    with pytest.raises(UnknownVersionError):
        call(core, "commit", version_id="nope", attempt=1, expected_default_revision=0)
    with pytest.raises(UnknownEngineError):
        call(core, "observe_incarnation", engine="e9", incarnation="x")
    with pytest.raises(ValueError, match="at least one engine"):
        type(core)(engines=(), capacity=2)
    with pytest.raises(ValueError, match="duplicate"):
        type(core)(engines=("a", "a"), capacity=2)
    with pytest.raises(ValueError, match="capacity"):
        type(core)(engines=("a",), capacity=0)


def test_abort_and_cleanup_follow_the_transition_table() -> None:
    core = new_core(published="A")
    with pytest.raises(InvalidStateError):
        call(core, "abort", version_id="A", attempt=1, reason="too late")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    with pytest.raises(InvalidStateError):
        call(core, "confirm_cleanup", version_id="B", attempt=1, engine=E0)
    call(core, "abort", version_id="B", attempt=rb.attempt, reason="x")
    again = call(core, "abort", version_id="B", attempt=rb.attempt, reason="x")
    assert again.state is VersionState.ABORTED
    with pytest.raises(InvalidStateError):
        call(core, "record_ready", receipt=receipt(core, rb, E0))
    with pytest.raises(InvalidStateError):
        call(core, "commit", version_id="B", attempt=1, expected_default_revision=1)
    for e in (E0, E1):
        call(core, "confirm_cleanup", version_id="B", attempt=1, engine=e)
    done = call(core, "confirm_cleanup", version_id="B", attempt=1, engine=E0)
    assert done.state is VersionState.FAILED_CLEAN
    assert (
        call(core, "abort", version_id="B", attempt=1, reason="x").state
        is VersionState.FAILED_CLEAN
    )


def test_late_duplicate_ready_after_commit_is_harmless() -> None:
    core = new_core()
    ra = publish(core, "A")
    status = call(core, "record_ready", receipt=receipt(core, ra, E0))
    assert status.state is VersionState.PUBLISHED
    assert core.default_revision == 1


def test_status_reports_versions_engines_and_capacity() -> None:
    core = new_core(published="A")
    bind(core, "s")
    st = core.status()
    assert st.default_version == "A"
    assert st.slots_in_use == 1
    assert st.live_sessions == 1
    assert [e.incarnation for e in st.engines] == ["inc-1", "inc-1"]
    assert st.versions[0].lora_name.startswith("policy_lora@0-A-")
