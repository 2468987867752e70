"""Engine membership in the registry core: every edge of the table, a typed refusal for every
illegal event, readiness over ACTIVE members only, routing only to ACTIVE members, and journal
replay restoring it all."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_lora.errors import DrainRefusedError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import MemberNotReadyError
from agentic_lora.errors import MembershipError
from agentic_lora.errors import NotReadyError
from agentic_lora.errors import RemoveRefusedError
from agentic_lora.errors import UnknownEngineError
from agentic_lora.errors import error_from_code
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.membership import TRANSITIONS
from agentic_lora.registry.membership import MemberEvent
from agentic_lora.registry.membership import advance
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import ReadyReceipt
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
from .util import registry_image

E2 = "e2"
M = MemberState


def _observe(core: RegistryCore, engine: str, incarnation: str = "inc-1") -> None:
    call(core, "observe_incarnation", engine=engine, incarnation=incarnation)


def _load_all(core: RegistryCore, engine: str, incarnation: str = "inc-1") -> None:
    """What a repair does on ``engine``: every dispatchable version loaded, its READY recorded."""
    for v in core.status().versions:
        if v.state.dispatchable:
            _ready_for(core, v.version_id, engine, incarnation)


def _ready_for(core: RegistryCore, version_id: str, engine: str, inc: str = "inc-1") -> None:
    ref = core.version(version_id).ref
    call(core, "record_ready", receipt=ReadyReceipt(engine=engine, ref=ref, incarnation=inc))


def _states(core: RegistryCore) -> dict[str, MemberState]:
    return {e.engine: e.membership for e in core.status().engines}


@pytest.mark.parametrize("state", list(MemberState))
@pytest.mark.parametrize("event", list(MemberEvent))
def test_every_event_either_follows_the_table_or_raises_its_own_typed_error(
    state: MemberState, event: MemberEvent
) -> None:
    if (state, event) in TRANSITIONS:
        assert advance("e", state, event) is TRANSITIONS[(state, event)]
        return
    with pytest.raises(MembershipError) as err:
        advance("e", state, event)
    assert err.value.details["state"] == state.value
    assert err.value.details["event"] == event.value
    # One stable code per refused event, each its own class, rebuilt from its code.
    assert err.value.code != MembershipError.code
    assert type(error_from_code(err.value.code, "x")) is type(err.value)


def test_the_configured_fleet_starts_active() -> None:
    core = new_core(published="v1")
    assert _states(core) == {E0: M.ACTIVE, E1: M.ACTIVE}
    assert core.active_members() == (E0, E1)


def test_a_joining_engine_is_not_routable_until_it_holds_every_dispatchable_version() -> None:
    core = new_core(capacity=3, published="v1")
    bind(core, "s1")  # s1 stays on v1
    publish(core, "v2")
    assert call(core, "join_engine", engine=E2) is M.JOINING
    assert core.dispatch_view("v2").ready_engines == (E0, E1)  # type: ignore[union-attr]
    # Its READY for the new default alone is not enough: v1 is still bound.
    with pytest.raises(MemberNotReadyError) as err:
        call(core, "activate_engine", engine=E2, incarnation="inc-1")
    assert err.value.details["current_incarnation"] is None  # not observed yet
    _observe(core, E2)
    _ready_for(core, "v2", E2)
    with pytest.raises(MemberNotReadyError) as err:
        call(core, "activate_engine", engine=E2, incarnation="inc-1")
    assert err.value.details["missing"] == ["v1"]
    assert _states(core)[E2] is M.JOINING
    _load_all(core, E2)
    assert call(core, "activate_engine", engine=E2, incarnation="inc-1") is M.ACTIVE
    assert core.dispatch_view("v1").ready_engines == (E0, E1, E2)  # type: ignore[union-attr]
    assert core.active_members() == (E0, E1, E2)


def test_a_joining_engine_needs_the_default_bound_versions_and_the_candidate_only() -> None:
    core = new_core(capacity=4, published="v1")
    bind(core, "s1")  # v1 stays bound
    publish(core, "v2")  # v2 is RETIRED once v3 commits, and nobody holds it
    publish(core, "v3")
    r = call(core, "reserve", version_id="v4", digest=digest_of("v4"))  # pending candidate
    call(core, "join_engine", engine=E2)
    _observe(core, E2)
    with pytest.raises(MemberNotReadyError) as err:
        call(core, "activate_engine", engine=E2, incarnation="inc-1")
    assert err.value.details["missing"] == ["v1", "v3", "v4"]
    for version_id in ("v1", "v3"):
        _ready_for(core, version_id, E2)
    ready(core, r, E2)
    assert call(core, "activate_engine", engine=E2, incarnation="inc-1") is M.ACTIVE
    assert core.dispatch_view("v2").ready_engines == (E0, E1)  # type: ignore[union-attr]
    # Once s1 is gone, v1 is not needed either: an ejected, restarted member needs v3 and v4.
    close(core, "s1")
    call(core, "eject_engine", engine=E2, incarnation="inc-1")
    _observe(core, E2, "inc-2")
    with pytest.raises(MemberNotReadyError) as err:
        call(core, "activate_engine", engine=E2, incarnation="inc-2")
    assert err.value.details["missing"] == ["v3", "v4"]


def test_commit_needs_every_active_member_and_only_those() -> None:
    core = new_core(capacity=3, published="v1")
    call(core, "join_engine", engine=E2)  # joining: not counted
    r = call(core, "reserve", version_id="v2", digest=digest_of("v2"))
    assert r.engines == (E0, E1)
    ready(core, r, E0)
    with pytest.raises(NotReadyError) as err:
        call(core, "commit", version_id="v2", attempt=1, expected_default_revision=1)
    assert err.value.details["missing"] == [E1]
    ready(core, r, E1)
    call(core, "commit", version_id="v2", attempt=1, expected_default_revision=1)
    assert core.default_version == "v2"


def test_an_ejected_engine_leaves_the_publication_set_fenced_by_its_incarnation() -> None:
    core = new_core(capacity=3, published="v1")
    _observe(core, E0)
    _observe(core, E1)
    r = call(core, "reserve", version_id="v2", digest=digest_of("v2"))
    ready(core, r, E0)
    # An ejection decided against an older process of e1 is refused and changes nothing.
    with pytest.raises(EngineRestartedError):
        call(core, "eject_engine", engine=E1, incarnation="inc-0")
    assert _states(core)[E1] is M.ACTIVE
    assert call(core, "eject_engine", engine=E1, incarnation="inc-1") is M.EJECTED
    # The pending publication commits over the live member; e1 gets no request.
    call(core, "commit", version_id="v2", attempt=1, expected_default_revision=1)
    assert core.dispatch_view("v2").ready_engines == (E0,)  # type: ignore[union-attr]
    assert core.dispatch_view("v1").ready_engines == (E0,)  # type: ignore[union-attr]
    # It rejoins only after repair: every dispatchable version under its observed incarnation.
    _observe(core, E1, "inc-2")  # it was restarted: holds nothing
    with pytest.raises(MemberNotReadyError) as err:
        call(core, "activate_engine", engine=E1, incarnation="inc-2")
    # v1 is RETIRED and no Session holds it: nothing can be routed to it, so it is not needed.
    assert err.value.details["missing"] == ["v2"]
    _load_all(core, E1, "inc-2")
    assert call(core, "activate_engine", engine=E1, incarnation="inc-2") is M.ACTIVE
    assert core.dispatch_view("v2").ready_engines == (E0, E1)  # type: ignore[union-attr]


def test_no_active_member_means_nothing_commits() -> None:
    core = RegistryCore(engines=(E0,), capacity=2)
    call(core, "eject_engine", engine=E0, incarnation=None)
    r = call(core, "reserve", version_id="v1", digest=digest_of("v1"))
    assert r.engines == ()
    with pytest.raises(NotReadyError):
        call(core, "commit", version_id="v1", attempt=1, expected_default_revision=0)


def test_a_draining_engine_gets_no_request_and_leaves_with_what_was_recorded_for_it() -> None:
    core = new_core(capacity=3, published="v1")
    bind(core, "s1")
    assert call(core, "drain_engine", engine=E1) is M.DRAINING
    # Sessions on it continue on the members that hold their version.
    assert core.dispatch_view("v1").ready_engines == (E0,)  # type: ignore[union-attr]
    # The last ACTIVE member cannot be drained.
    with pytest.raises(DrainRefusedError) as err:
        call(core, "drain_engine", engine=E0)
    assert err.value.details["reason"] == "last_active"
    assert call(core, "remove_engine", engine=E1) is M.REMOVED
    assert core.engines == (E0,)
    assert core.version("v1").ready_engines == (E0,)
    with pytest.raises(UnknownEngineError):
        call(core, "drain_engine", engine=E1)
    with pytest.raises(RemoveRefusedError):
        call(core, "remove_engine", engine=E0)  # ACTIVE: drain it first


def test_removing_an_engine_completes_a_reclaim_that_only_waited_for_it() -> None:
    core = new_core(capacity=3, published="v1")
    publish(core, "v2")
    claim = call(core, "claim_reclaim", version_id="v1")
    call(core, "confirm_reclaim", version_id="v1", reclaim_id=claim.reclaim_id, engine=E0)
    assert core.version("v1").state is VersionState.RECLAIMING
    call(core, "eject_engine", engine=E1, incarnation=None)
    call(core, "remove_engine", engine=E1)
    assert core.version("v1").state is VersionState.RECLAIMED


def test_a_removed_engine_can_join_again_and_starts_from_nothing() -> None:
    core = new_core(capacity=3, published="v1")
    call(core, "drain_engine", engine=E1)
    call(core, "remove_engine", engine=E1)
    assert call(core, "join_engine", engine=E1) is M.JOINING
    assert core.version("v1").ready_engines == (E0,)
    with pytest.raises(MemberNotReadyError):
        call(core, "activate_engine", engine=E1, incarnation="inc-1")


def test_snapshot_restores_membership() -> None:
    core = new_core(capacity=3, published="v1")
    call(core, "join_engine", engine=E2)
    call(core, "drain_engine", engine=E1)
    again = new_core(capacity=3)
    again.load_state(core.to_state())
    assert registry_image(again) == registry_image(core)
    assert _states(again) == {E0: M.ACTIVE, E1: M.DRAINING, E2: M.JOINING}


@pytest.mark.asyncio
async def test_journal_replay_restores_membership(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    reg = LocalRegistry(engines=(E0, E1), capacity=3, journal_path=path)
    await publish_by_verbs(reg, "v1", (E0, E1))
    assert await reg.join_engine(request_id=new_request_id(), engine=E2) is M.JOINING
    assert await reg.eject_engine(request_id=new_request_id(), engine=E1, incarnation=None) is (
        M.EJECTED
    )
    before = await reg.status()
    await reg.aclose()
    again = LocalRegistry(engines=(E0, E1), capacity=3, journal_path=path)
    after = await again.status()
    await again.aclose()
    assert after.engines == before.engines
    assert {e.engine: e.membership for e in after.engines} == {
        E0: M.ACTIVE,
        E1: M.EJECTED,
        E2: M.JOINING,
    }
