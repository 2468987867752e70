"""One named test per rule of owner leases, durable Session names and engine repair.

On :class:`RegistryCore` directly (every timed verb gets ``now=`` explicitly) and, where the front
end matters (clock injection, idempotent replays, journal replay, the post-restart lease grace),
on :class:`LocalRegistry` with an injected clock and no background sweeper.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import LeaseExpiredError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.registry.core import TIMED_VERBS
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import NamedSession
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.publish import publish_by_verbs

from .util import E0
from .util import E1
from .util import FakeClock
from .util import bind
from .util import bind_on
from .util import call
from .util import close
from .util import digest_of
from .util import lease
from .util import new_core
from .util import publish
from .util import ready
from .util import receipt
from .util import reclaim
from .util import registry_image

W, G = "worker", "gateway"
NAME_TTL = 100.0


def _refused(core: RegistryCore, verb: str, **args: Any) -> AgenticLoRAError:
    """Run a call that must be refused; prove it changed nothing at all (not even the clock)."""
    before = registry_image(core)
    with pytest.raises(AgenticLoRAError) as err:
        call(core, verb, **args)
    assert registry_image(core) == before, f"refused {verb} changed the registry"
    return err.value


def _state_of(core: RegistryCore, session: str) -> SessionState:
    s = core.session(session)
    assert s is not None
    return s.state


# --- open_lease --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("owner", "", "bad_owner"),
        ("owner", "has space", "bad_owner"),
        ("owner", "x" * 257, "bad_owner"),
        ("owner", "bell\x07", "bad_owner"),
        ("owner", 7, "bad_owner"),
        ("incarnation", "", "bad_incarnation"),
        ("incarnation", "tab\there", "bad_incarnation"),
        ("incarnation", None, "bad_incarnation"),
        ("ttl", 0, "bad_ttl"),
        ("ttl", -1.0, "bad_ttl"),
        ("ttl", float("nan"), "bad_ttl"),
        ("ttl", float("inf"), "bad_ttl"),
        ("ttl", True, "bad_ttl"),
        ("ttl", "10", "bad_ttl"),
        ("now", float("nan"), "bad_now"),
        ("now", float("-inf"), "bad_now"),
        ("now", True, "bad_now"),
        ("now", None, "bad_now"),
        ("on_restart", "restart", "bad_on_restart"),
        ("on_restart", "", "bad_on_restart"),
    ],
)
def test_open_lease_refuses_bad_input_and_changes_nothing(
    field: str, value: object, reason: str
) -> None:
    core = new_core(published="A")
    grant = lease(core, W, "i1", now=5.0)
    bind_on(core, "s1", grant.lease_id)
    # A new incarnation of a known owner: a refusal must not end the live lease either.
    args: dict[str, Any] = {
        "owner": W,
        "incarnation": "i2",
        "ttl": 10.0,
        "now": 50.0,
        "on_restart": "release",
    }
    args[field] = value
    err = _refused(core, "open_lease", **args)
    assert isinstance(err, InvalidStateError)
    assert err.details["reason"] == reason
    assert core.lease("worker/i1") is not None
    assert core.now == 5.0
    assert core.version("A").session_refs == 1


def test_open_lease_grants_a_lease_named_owner_slash_incarnation() -> None:
    core = new_core()
    grant = lease(core, W, "i1", now=3.0, ttl=7.0)
    assert (grant.lease_id, grant.owner, grant.incarnation) == ("worker/i1", W, "i1")
    assert (grant.ttl, grant.expires_at, grant.released, grant.adopted) == (7.0, 10.0, (), ())
    status = core.lease("worker/i1")
    assert status is not None
    assert (status.expires_at, status.sessions, status.names) == (10.0, 0, 0)
    assert core.now == 3.0


def test_open_lease_again_with_the_same_incarnation_renews_it() -> None:
    core = new_core(published="A")
    first = lease(core, W, "i1", now=0.0, ttl=10.0)
    bind_on(core, "s1", first.lease_id)
    again = lease(core, W, "i1", now=4.0, ttl=20.0, on_restart="adopt")
    assert again.lease_id == first.lease_id
    assert (again.ttl, again.expires_at, again.released, again.adopted) == (20.0, 24.0, (), ())
    # Nothing of the owner's ended: its Session still holds its ref on the same lease.
    assert _state_of(core, "s1") is SessionState.BOUND
    assert core.version("A").session_refs == 1
    status = core.lease(first.lease_id)
    assert status is not None
    assert status.sessions == 1


def test_new_incarnation_with_release_expires_the_predecessors_sessions_at_once() -> None:
    core = new_core(published="A")
    old = lease(core, W, "i1", now=0.0)
    for s in ("s1", "s2", "s3", "s4"):
        bind_on(core, s, old.lease_id)
    call(core, "begin_close", session_key="s3")  # CLOSING: still holds its ref
    close(core, "s4")  # CLOSED: its ref is already gone
    call(core, "open_named", name="n1", session_key="k1", lease=old.lease_id, now=1.0)
    bind(core, "k1")
    assert core.version("A").session_refs == 4

    new = lease(core, W, "i2", now=2.0, on_restart="release")

    assert new.released == ("k1", "s1", "s2", "s3")  # sorted; s4 was not holding a ref
    assert new.adopted == ()
    assert core.version("A").session_refs == 0
    for s in ("k1", "s1", "s2", "s3"):
        assert _state_of(core, s) is SessionState.EXPIRED
    assert _state_of(core, "s4") is SessionState.CLOSED
    assert core.lease(old.lease_id) is None
    status = core.lease(new.lease_id)
    assert status is not None
    assert (status.sessions, status.names) == (0, 0)
    # The name died with its lease: it can never open a second lifecycle.
    with pytest.raises(SessionExpiredError) as err:
        call(core, "open_named", name="n1", session_key="k9", lease=new.lease_id, now=3.0)
    assert err.value.details["reason"] == "owner_restarted"
    assert core.named("n1") is None


def test_new_incarnation_with_adopt_moves_sessions_and_names_to_the_new_lease() -> None:
    core = new_core(published="A")
    old = lease(core, G, "g1", now=0.0)
    bind_on(core, "s1", old.lease_id)
    call(core, "open_named", name="bound", session_key="k1", lease=old.lease_id, now=0.0)
    bind(core, "k1")
    call(core, "open_named", name="fresh", session_key="k2", lease=old.lease_id, now=0.0)

    new = lease(core, G, "g2", now=1.0, on_restart="adopt")

    assert new.adopted == ("k1", "s1")  # the Sessions holding a ref; names follow silently
    assert new.released == ()
    assert core.version("A").session_refs == 2
    for s in ("s1", "k1"):
        status = core.session(s)
        assert status is not None
        assert (status.state, status.lease) == (SessionState.BOUND, new.lease_id)
    lease_status = core.lease(new.lease_id)
    assert lease_status is not None
    assert (lease_status.sessions, lease_status.names) == (2, 2)
    assert core.lease(old.lease_id) is None
    # The names answer on the new lease with no further move, and keep their bindings.
    again = call(core, "open_named", name="bound", session_key="ignored", lease=new.lease_id, now=2)
    assert (again.session_key, again.lease, again.adopted) == ("k1", new.lease_id, False)
    assert again.binding is not None
    assert again.binding.version_id == "A"
    # An unbound adopted name binds under the new lease, and its expiry releases everything.
    bind(core, "k2")
    status = core.session("k2")
    assert status is not None
    assert status.lease == new.lease_id
    swept = call(core, "sweep", now=new.expires_at, name_ttl=NAME_TTL)
    assert swept.expired_sessions == ("k1", "k2", "s1")
    assert core.version("A").session_refs == 0


@pytest.mark.parametrize(
    ("end", "why"),
    [("restart", "owner_restarted"), ("expiry", "expired"), ("close", "owner_closed")],
)
def test_a_dead_incarnation_can_never_reopen(end: str, why: str) -> None:
    core = new_core()
    lease(core, W, "i1", now=0.0, ttl=5.0)
    if end == "restart":
        lease(core, W, "i2", now=1.0)
    elif end == "expiry":
        call(core, "sweep", now=5.0, name_ttl=NAME_TTL)
    else:
        call(core, "close_lease", owner=W, incarnation="i1")
    for verb, extra in (("open_lease", {"ttl": 5.0}), ("renew_lease", {})):
        err = _refused(core, verb, owner=W, incarnation="i1", now=9.0, **extra)
        assert isinstance(err, LeaseExpiredError)
        assert err.details == {"lease": "worker/i1", "reason": why}


def test_the_memory_of_dead_incarnations_is_bounded() -> None:
    core = new_core()
    for n in range(4100):
        lease(core, W, f"i{n}", now=float(n))
    dead = registry_image(core)["dead_leases"]
    assert len(dead) == 4096  # bounded: the oldest ended incarnations are forgotten first
    assert dead[0] == ["worker/i3", "owner_restarted"]
    assert dead[-1] == ["worker/i4098", "owner_restarted"]
    assert isinstance(
        _refused(core, "renew_lease", owner=W, incarnation="i3", now=5e3), LeaseExpiredError
    )


# --- renew, sweep, close, resume ---------------------------------------------------------------


def test_renew_extends_a_live_lease_by_its_ttl_from_now() -> None:
    core = new_core()
    lease(core, W, "i1", now=0.0, ttl=10.0)
    grant = call(core, "renew_lease", owner=W, incarnation="i1", now=6.0)
    assert (grant.expires_at, grant.ttl, grant.released, grant.adopted) == (16.0, 10.0, (), ())
    # Not due at the old deadline any more.
    assert call(core, "sweep", now=10.0, name_ttl=NAME_TTL) == SweepResult()
    assert core.lease("worker/i1") is not None


def test_renew_of_a_lease_never_granted_is_lease_expired() -> None:
    err = _refused(new_core(), "renew_lease", owner=W, incarnation="nope", now=1.0)
    assert isinstance(err, LeaseExpiredError)
    assert err.details["reason"] == "unknown"


def test_renew_after_the_expiry_sweep_is_lease_expired() -> None:
    core = new_core()
    lease(core, W, "i1", now=0.0, ttl=10.0)
    call(core, "sweep", now=10.0, name_ttl=NAME_TTL)
    err = _refused(core, "renew_lease", owner=W, incarnation="i1", now=10.5)
    assert err.code == "LEASE_EXPIRED"


def test_a_lease_past_its_deadline_lives_until_a_sweep_decides() -> None:
    # Expiry is decided in one place (the sweep), so a renewal that arrives late but before the
    # sweep still counts; the holder is expected to renew well inside its own TTL anyway.
    core = new_core(published="A")
    grant = lease(core, W, "i1", now=0.0, ttl=10.0)
    assert core.sweep_due(12.0, NAME_TTL)
    bind_on(core, "s1", grant.lease_id)
    assert call(core, "renew_lease", owner=W, incarnation="i1", now=12.0).expires_at == 22.0
    assert not core.sweep_due(12.0, NAME_TTL)
    assert _state_of(core, "s1") is SessionState.BOUND


def test_sweep_expires_exactly_the_leases_whose_deadline_is_reached() -> None:
    core = new_core(published="A")
    a = lease(core, "a", "1", now=0.0, ttl=10.0)  # deadline 10.0
    b = lease(core, "b", "1", now=0.5, ttl=10.0)  # deadline 10.5
    c = lease(core, "c", "1", now=1.0, ttl=10.0)  # deadline 11.0
    for key, grant in (("a1", a), ("a2", a), ("a3", a), ("b1", b), ("c1", c)):
        bind_on(core, key, grant.lease_id)
    call(core, "begin_close", session_key="a2")  # CLOSING: still holds its ref
    close(core, "a3")  # CLOSED: already released, not to be counted twice
    assert core.version("A").session_refs == 4

    assert call(core, "sweep", now=9.999, name_ttl=NAME_TTL) == SweepResult()
    result = call(core, "sweep", now=10.5, name_ttl=NAME_TTL)

    assert result == SweepResult(("a/1", "b/1"), ("a1", "a2", "b1"), 0)
    assert core.version("A").session_refs == 1  # only c1 still holds one
    assert [s.lease_id for s in core.status().leases] == ["c/1"]
    assert _state_of(core, "a2") is SessionState.EXPIRED
    assert _state_of(core, "a3") is SessionState.CLOSED
    assert _state_of(core, "c1") is SessionState.BOUND


def test_sweep_refuses_a_bad_name_ttl_and_changes_nothing() -> None:
    core = new_core()
    lease(core, W, "i1", now=0.0, ttl=1.0)
    for bad in (0, -1.0, float("nan"), True):
        err = _refused(core, "sweep", now=5.0, name_ttl=bad)
        assert err.details["reason"] == "bad_name_ttl"
    assert core.lease("worker/i1") is not None


def test_a_closing_session_whose_lease_expires_releases_late_without_a_second_decrement() -> None:
    core = new_core(published="A")
    grant = lease(core, W, "i1", now=0.0, ttl=10.0)
    bind_on(core, "s1", grant.lease_id)
    bind_on(core, "s2", grant.lease_id)
    call(core, "begin_close", session_key="s1")
    call(core, "sweep", now=10.0, name_ttl=NAME_TTL)
    assert core.version("A").session_refs == 0
    for _ in range(2):
        result = call(core, "release", session_key="s1")
        assert (result.version_id, result.released_now) == ("A", False)
        assert core.version("A").session_refs == 0
    # begin_close on an EXPIRED Session succeeds and leaves it EXPIRED (a tombstone).
    status = call(core, "begin_close", session_key="s2")
    assert status.state is SessionState.EXPIRED
    assert call(core, "release", session_key="s2").released_now is False
    assert core.version("A").session_refs == 0
    # Tombstones that hold nothing may be forgotten; the version may then be reclaimed.
    assert call(core, "forget_sessions", session_keys=["s1", "s2"]) == 2
    publish(core, "B")
    reclaim(core, "A")
    assert core.version("A").state is VersionState.RECLAIMED


def test_bind_first_on_an_expired_session_is_session_expired() -> None:
    core = new_core(published="A")
    grant = lease(core, W, "i1", now=0.0, ttl=10.0)
    bind_on(core, "s1", grant.lease_id)
    call(core, "sweep", now=10.0, name_ttl=NAME_TTL)
    other = lease(core, W, "i2", now=11.0)
    for lease_id in (None, other.lease_id):
        err = _refused(core, "bind_first", session_key="s1", lease=lease_id)
        assert isinstance(err, SessionExpiredError)
        assert err.details["state"] == "EXPIRED"


@pytest.mark.parametrize("how", ["never_granted", "expired", "superseded", "closed"])
def test_bind_first_under_a_dead_lease_is_lease_expired_and_takes_no_ref(how: str) -> None:
    core = new_core(published="A")
    lease(core, W, "i1", now=0.0, ttl=10.0)
    if how == "expired":
        call(core, "sweep", now=10.0, name_ttl=NAME_TTL)
    elif how == "superseded":
        lease(core, W, "i2", now=1.0)
    elif how == "closed":
        call(core, "close_lease", owner=W, incarnation="i1")
    lease_id = "worker/never" if how == "never_granted" else "worker/i1"
    err = _refused(core, "bind_first", session_key="s1", lease=lease_id)
    assert isinstance(err, LeaseExpiredError)
    assert core.session("s1") is None
    assert core.version("A").session_refs == 0


def test_close_lease_releases_its_sessions_and_is_idempotent() -> None:
    core = new_core(published="A")
    grant = lease(core, W, "i1", now=0.0)
    bind_on(core, "s1", grant.lease_id)
    bind_on(core, "s2", grant.lease_id)
    close(core, "s2")
    bind_on(core, "free", None)  # no lease: no owner can take it away
    assert call(core, "close_lease", owner=W, incarnation="i1") == ("s1",)
    assert _state_of(core, "s1") is SessionState.EXPIRED
    assert core.version("A").session_refs == 1
    # Closing again (a fresh request id: not an idempotent replay) finds nothing to end.
    assert call(core, "close_lease", owner=W, incarnation="i1") == ()
    assert call(core, "close_lease", owner="stranger", incarnation="x") == ()
    assert core.version("A").session_refs == 1
    assert _state_of(core, "free") is SessionState.BOUND
    # The owner may start a new incarnation afterwards; the closed one stays dead.
    assert lease(core, W, "i2", now=1.0).released == ()


def test_resume_leases_gives_every_live_lease_a_full_ttl_and_never_shortens_one() -> None:
    core = new_core()
    lease(core, "a", "1", now=0.0, ttl=10.0)  # deadline 10
    lease(core, "b", "1", now=0.0, ttl=100.0)  # deadline 100
    lease(core, "c", "1", now=0.0, ttl=1.0)
    call(core, "close_lease", owner="c", incarnation="1")  # dead: not resumed
    assert call(core, "resume_leases", now=50.0) == 2
    expiries = {s.lease_id: s.expires_at for s in core.status().leases}
    assert expiries == {"a/1": 60.0, "b/1": 150.0}
    # A resume at an earlier time (the host's clock stepped back) shortens nothing.
    assert call(core, "resume_leases", now=20.0) == 2
    assert {s.lease_id: s.expires_at for s in core.status().leases} == expiries
    assert core.now == 50.0


def test_now_never_goes_backwards() -> None:
    core = new_core()
    lease(core, W, "i1", now=10.0)
    assert core.now == 10.0
    lease(core, "other", "1", now=4.0, ttl=1.0)  # an earlier clock reading is still accepted
    call(core, "sweep", now=7.0, name_ttl=NAME_TTL)  # sweeps at its own time: 4 + 1 <= 7
    assert core.now == 10.0
    assert core.lease("other/1") is None
    assert core.lease("worker/i1") is not None


@pytest.mark.parametrize(
    ("verb", "args"),
    [
        ("open_lease", {"owner": W, "incarnation": "i1", "ttl": 5.0, "on_restart": "bogus"}),
        ("open_lease", {"owner": W, "incarnation": "old", "ttl": 5.0}),
        ("renew_lease", {"owner": W, "incarnation": "unknown"}),
        ("sweep", {"name_ttl": -1.0}),
        ("open_named", {"name": "closed", "session_key": "k2", "lease": None}),
        ("open_named", {"name": "n", "session_key": "k", "lease": "worker/gone"}),
        ("open_named", {"name": "fresh", "session_key": "k_closed", "lease": None}),
    ],
)
def test_a_refused_timed_verb_does_not_move_the_registry_clock(
    verb: str, args: dict[str, Any]
) -> None:
    # A refused call is not journaled: had it moved the clock, the next tombstone would get
    # another time live than in a journal replay.
    core = new_core()
    lease(core, W, "old", now=1.0)
    lease(core, W, "i0", now=2.0)  # "old" is dead now
    call(core, "open_named", name="closed", session_key="k_closed", lease=None, now=3.0)
    call(core, "begin_close", session_key="k_closed")
    assert verb in TIMED_VERBS
    _refused(core, verb, now=99.0, **args)
    assert core.now == 3.0


def test_a_replayed_request_id_with_a_later_now_returns_the_original_answer() -> None:
    core = new_core()
    first, applied = core.execute(
        "rid-1", "open_lease", {"owner": W, "incarnation": "i1", "ttl": 10.0, "now": 0.0}
    )
    assert applied
    again, applied = core.execute(
        "rid-1", "open_lease", {"owner": W, "incarnation": "i1", "ttl": 10.0, "now": 50.0}
    )
    assert not applied
    assert again == first
    assert core.now == 0.0
    status = core.lease("worker/i1")
    assert status is not None
    assert status.expires_at == 10.0
    # The fingerprint still covers everything else.
    with pytest.raises(InvalidStateError) as err:
        core.execute(
            "rid-1", "open_lease", {"owner": W, "incarnation": "i1", "ttl": 11.0, "now": 50.0}
        )
    assert err.value.details["reason"] == "request_id_reused"


# --- durable Session names ---------------------------------------------------------------------


def test_open_named_first_use_records_the_callers_key() -> None:
    core = new_core()
    grant = lease(core, G, "g1", now=0.0)
    named = call(core, "open_named", name="chat-1", session_key="k1", lease=grant.lease_id, now=1)
    assert named == NamedSession("chat-1", "k1", grant.lease_id, None, adopted=False)
    assert core.named("chat-1") == named
    assert core.session("k1") is None  # no registry Session until the first bind
    status = core.lease(grant.lease_id)
    assert status is not None
    assert (status.sessions, status.names) == (0, 1)
    assert core.status().named_sessions == 1


def test_open_named_again_returns_the_same_key_and_its_binding() -> None:
    core = new_core(published="A")
    grant = lease(core, G, "g1", now=0.0)
    call(core, "open_named", name="chat-1", session_key="k1", lease=grant.lease_id, now=0.0)
    binding = bind(core, "k1")
    publish(core, "B")  # the default moves on; the name's Session does not
    again = call(core, "open_named", name="chat-1", session_key="k2", lease=grant.lease_id, now=1)
    assert (again.session_key, again.adopted) == ("k1", False)
    assert again.binding is not None
    assert again.binding.version_id == binding == "A"
    assert core.session("k2") is None


def test_open_named_from_another_lease_adopts_the_name_and_its_session() -> None:
    core = new_core(published="A")
    g1 = lease(core, G, "g1", now=0.0)
    g2 = lease(core, "gateway-b", "1", now=0.0, ttl=50.0)
    call(core, "open_named", name="chat-1", session_key="k1", lease=g1.lease_id, now=0.0)
    bind(core, "k1")
    moved = call(core, "open_named", name="chat-1", session_key="kx", lease=g2.lease_id, now=1.0)
    assert (moved.session_key, moved.lease, moved.adopted) == ("k1", g2.lease_id, True)
    assert moved.binding is not None
    assert moved.binding.version_id == "A"
    s1, s2 = core.lease(g1.lease_id), core.lease(g2.lease_id)
    assert s1 is not None
    assert (s1.sessions, s1.names) == (0, 0)
    assert s2 is not None
    assert (s2.sessions, s2.names) == (1, 1)
    # g1's expiry no longer touches it; g2's does.
    assert call(core, "sweep", now=10.0, name_ttl=NAME_TTL).expired_sessions == ()
    assert _state_of(core, "k1") is SessionState.BOUND
    assert call(core, "sweep", now=50.0, name_ttl=NAME_TTL).expired_sessions == ("k1",)
    # Moving to no lease at all detaches it from every owner: no expiry can touch it.
    g3 = lease(core, "gateway-c", "1", now=50.0, ttl=10.0)
    call(core, "open_named", name="free", session_key="kf", lease=g3.lease_id, now=50.0)
    bind(core, "kf")
    assert call(core, "open_named", name="free", session_key="kf", lease=None, now=51).adopted
    assert call(core, "sweep", now=60.0, name_ttl=NAME_TTL).expired_sessions == ()
    assert _state_of(core, "kf") is SessionState.BOUND


def test_bind_first_of_a_named_key_binds_under_the_names_lease() -> None:
    core = new_core(published="A")
    g1 = lease(core, G, "g1", now=0.0)
    other = lease(core, "other", "1", now=0.0)
    call(core, "open_named", name="chat-1", session_key="k1", lease=g1.lease_id, now=0.0)
    bind_on(core, "k1", other.lease_id)
    status = core.session("k1")
    assert status is not None
    assert status.lease == g1.lease_id


def test_open_named_after_begin_close_is_session_closed_even_with_a_new_key() -> None:
    core = new_core(published="A")
    grant = lease(core, G, "g1", now=0.0)
    call(core, "open_named", name="chat-1", session_key="k1", lease=grant.lease_id, now=0.0)
    bind(core, "k1")
    call(core, "begin_close", session_key="k1")
    call(core, "begin_close", session_key="k1")  # a second close keeps the first tombstone
    for key in ("k1", "k2"):
        err = _refused(
            core, "open_named", name="chat-1", session_key=key, lease=grant.lease_id, now=1.0
        )
        assert isinstance(err, SessionClosedError)
        assert err.details == {"session": "chat-1", "reason": "closed"}
    # bind_first of the key is refused too, even after its record was forgotten.
    call(core, "release", session_key="k1")
    call(core, "forget_sessions", session_keys=["k1"])
    assert isinstance(_refused(core, "bind_first", session_key="k1"), SessionClosedError)
    assert core.named("chat-1") is None


def test_open_named_after_its_lease_expired_is_session_expired() -> None:
    core = new_core(published="A")
    grant = lease(core, G, "g1", now=0.0, ttl=10.0)
    call(core, "open_named", name="chat-1", session_key="k1", lease=grant.lease_id, now=0.0)
    call(core, "open_named", name="idle", session_key="k2", lease=grant.lease_id, now=0.0)
    bind(core, "k1")
    call(core, "sweep", now=10.0, name_ttl=NAME_TTL)
    fresh = lease(core, G, "g2", now=11.0)
    for name in ("chat-1", "idle"):  # bound or not, the name died with its lease
        err = _refused(
            core, "open_named", name=name, session_key="k3", lease=fresh.lease_id, now=11.0
        )
        assert isinstance(err, SessionExpiredError)
        assert err.details["reason"] == "expired"
    # The unbound name's key can never bind either.
    err = _refused(core, "bind_first", session_key="k2", lease=fresh.lease_id)
    assert isinstance(err, SessionExpiredError)


def test_a_name_tombstone_is_forgotten_by_the_sweep_after_name_ttl_and_only_then() -> None:
    core = new_core(published="A")
    call(core, "open_named", name="chat-1", session_key="k1", lease=None, now=5.0)
    bind(core, "k1")
    call(core, "begin_close", session_key="k1")  # tombstoned at core.now == 5.0
    call(core, "release", session_key="k1")
    assert not core.sweep_due(5.0 + NAME_TTL - 0.001, NAME_TTL)
    result = call(core, "sweep", now=5.0 + NAME_TTL - 0.001, name_ttl=NAME_TTL)
    assert result.forgotten_names == 0
    with pytest.raises(SessionClosedError):
        call(core, "open_named", name="chat-1", session_key="k2", lease=None, now=50.0)
    assert core.sweep_due(5.0 + NAME_TTL, NAME_TTL)
    assert call(core, "sweep", now=5.0 + NAME_TTL, name_ttl=NAME_TTL).forgotten_names == 1
    # The old key's record is still there (CLOSED), so only a new key opens a new lifecycle.
    with pytest.raises(InvalidStateError) as err:
        call(core, "open_named", name="chat-1", session_key="k1", lease=None, now=200.0)
    assert err.value.details["reason"] == "session_key_in_use"
    again = call(core, "open_named", name="chat-1", session_key="k2", lease=None, now=200.0)
    assert (again.session_key, again.binding) == ("k2", None)


def test_open_named_refuses_bad_names_and_keys_in_use() -> None:
    core = new_core(published="A")
    bind(core, "taken")
    call(core, "open_named", name="n1", session_key="k1", lease=None, now=0.0)
    for args, reason in (
        ({"name": "", "session_key": "k"}, "bad_name"),
        ({"name": "n x", "session_key": "k"}, "bad_name"),
        ({"name": "n", "session_key": ""}, "bad_session_key"),
        ({"name": "n", "session_key": "taken"}, "session_key_in_use"),
        ({"name": "n2", "session_key": "k1"}, "session_key_in_use"),
    ):
        err = _refused(core, "open_named", lease=None, now=1.0, **args)
        assert err.details["reason"] == reason


@pytest.mark.parametrize("t", [0.0, 9.999, 10.0, 10.5, 14.999, 15.0, 104.999, 105.0, 1e9])
def test_sweep_due_agrees_with_what_sweep_does(t: float) -> None:
    core = new_core(published="A")
    lease(core, "a", "1", now=0.0, ttl=10.0)  # due at 10
    lease(core, "b", "1", now=0.0, ttl=15.0)  # due at 15
    call(core, "open_named", name="n", session_key="k", lease=None, now=5.0)
    call(core, "begin_close", session_key="k")  # tombstone due at 5 + NAME_TTL
    due = core.sweep_due(t, NAME_TTL)
    result = call(core, "sweep", now=t, name_ttl=NAME_TTL)
    assert due == (result != SweepResult())
    assert due == (t >= 10.0)


# --- engine restarts and repair ----------------------------------------------------------------


def _restart(core: RegistryCore, engine: str, incarnation: str) -> bool:
    changed: bool = call(core, "observe_incarnation", engine=engine, incarnation=incarnation)
    return changed


@pytest.mark.parametrize("retired", [False, True])
def test_an_engine_restart_drops_it_from_a_dispatchable_versions_ready_engines(
    retired: bool,
) -> None:
    core = new_core(published="A")
    bind(core, "s1")
    if retired:
        publish(core, "B")
    state = VersionState.RETIRED if retired else VersionState.PUBLISHED
    assert core.version("A").state is state
    assert _restart(core, E1, "inc-2")
    a = core.version("A")
    assert (a.state, a.ready_engines, a.session_refs) == (state, (E0,), 1)
    # The same incarnation again is not a restart.
    assert not _restart(core, E1, "inc-2")
    assert core.version("A").ready_engines == (E0,)


def test_a_repair_ready_from_the_current_incarnation_re_adds_the_engine() -> None:
    core = new_core(published="A")
    ra = core.version("A")
    _restart(core, E1, "inc-2")
    r = call(core, "reserve", version_id="A", digest=ra.digest)  # the committed reservation
    repaired = call(core, "record_ready", receipt=receipt(core, r, E1, "inc-2"))
    assert repaired.ready_engines == (E0, E1)
    assert repaired.state is VersionState.PUBLISHED
    assert core.default_revision == 1  # a repair never touches the default


@pytest.mark.parametrize("named", ["inc-1", "inc-3"], ids=["old", "unobserved_newer"])
def test_a_ready_from_an_incarnation_other_than_the_observed_one_is_engine_restarted(
    named: str,
) -> None:
    core = new_core(published="A")
    r = call(core, "reserve", version_id="A", digest=digest_of("A"))
    _restart(core, E1, "inc-2")
    err = _refused(core, "record_ready", receipt=receipt(core, r, E1, named))
    assert isinstance(err, EngineRestartedError)
    assert (err.details["incarnation"], err.details["current_incarnation"]) == (named, "inc-2")
    assert core.version("A").ready_engines == (E0,)


@pytest.mark.parametrize("state", ["RECLAIMING", "RECLAIMED"])
def test_a_repair_ready_for_a_version_on_its_way_out_is_a_no_op(state: str) -> None:
    core = new_core(published="A")
    r = call(core, "reserve", version_id="A", digest=digest_of("A"))
    publish(core, "B")
    claim = call(core, "claim_reclaim", version_id="A")
    if state == "RECLAIMED":
        for e in core.engines:
            call(core, "confirm_reclaim", version_id="A", reclaim_id=claim.reclaim_id, engine=e)
    before = registry_image(core)
    status = call(core, "record_ready", receipt=receipt(core, r, E1, "inc-1"))
    assert status.state.value == state
    after = registry_image(core)
    # Only the call's own bookkeeping moved (seq, the remembered result).
    assert {k: v for k, v in after.items() if k not in ("seq", "done")} == {
        k: v for k, v in before.items() if k not in ("seq", "done")
    }


def test_a_restart_counts_as_cleanup_of_an_aborted_attempt_and_frees_its_slot() -> None:
    core = new_core(published="A")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb, E0, E1)
    call(core, "abort", version_id="B", attempt=rb.attempt, reason="test")
    call(core, "confirm_cleanup", version_id="B", attempt=rb.attempt, engine=E0)
    assert core.status().slots_in_use == 2
    assert core.status().pending_version == "B"
    _restart(core, E1, "inc-2")
    b = core.version("B")
    assert (b.state, b.cleaned_engines) == (VersionState.FAILED_CLEAN, (E0, E1))
    assert core.status().slots_in_use == 1
    assert core.status().pending_version is None
    # The freed slot and the cleared pending flag let the retry start.
    retry = call(core, "reserve", version_id="B", digest=digest_of("B"))
    assert (retry.outcome.value, retry.attempt) == ("RETRY_STARTED", 2)


def test_a_restart_of_one_engine_alone_does_not_free_an_aborted_slot() -> None:
    core = new_core(published="A")
    rb = call(core, "reserve", version_id="B", digest=digest_of("B"))
    call(core, "abort", version_id="B", attempt=rb.attempt, reason="test")
    _restart(core, E0, "inc-2")
    b = core.version("B")
    assert (b.state, b.cleaned_engines) == (VersionState.ABORTED, (E0,))
    assert core.status().slots_in_use == 2


def test_a_restart_counts_as_reclaim_of_a_reclaiming_version() -> None:
    core = new_core(published="A")
    publish(core, "B")
    claim = call(core, "claim_reclaim", version_id="A")
    call(core, "confirm_reclaim", version_id="A", reclaim_id=claim.reclaim_id, engine=E0)
    _restart(core, E1, "inc-2")
    a = core.version("A")
    assert (a.state, a.reclaimed_engines) == (VersionState.RECLAIMED, (E0, E1))
    assert core.status().slots_in_use == 1
    # B (PUBLISHED) lost E1 meanwhile: the same restart voided its holding.
    assert core.version("B").ready_engines == (E0,)


def test_a_first_sighting_of_an_engine_changes_nothing_else() -> None:
    core = new_core()
    ra = call(core, "reserve", version_id="A", digest=digest_of("A"))
    ready(core, ra, E0)
    call(core, "abort", version_id="A", attempt=ra.attempt, reason="test")
    before = registry_image(core)
    assert _restart(core, E1, "first")
    after = registry_image(core)
    assert after["incarnations"] == {E0: "inc-1", E1: "first"}
    assert after["versions"] == before["versions"]  # no cleanup credited: no process ended
    assert core.version("A").state is VersionState.ABORTED


def test_a_ready_from_a_newer_incarnation_counts_once_it_is_observed() -> None:
    core = new_core(published="A")
    r = call(core, "reserve", version_id="A", digest=digest_of("A"))
    _restart(core, E1, "inc-2")
    _restart(core, E1, "inc-3")  # refused before this: see the test above
    assert call(core, "record_ready", receipt=receipt(core, r, E1, "inc-3")).ready_engines == (
        E0,
        E1,
    )


# --- snapshot and journal ----------------------------------------------------------------------


def _rich_scenario(core: RegistryCore) -> None:
    """Leases (live, superseded, expired, closed), names (live, adopted, tombstoned), Sessions in
    every state, an engine restart and a repair: every kind of record the core keeps."""
    publish(core, "A")
    w1 = lease(core, W, "i1", now=1.0, ttl=10.0)
    g1 = lease(core, G, "g1", now=1.0, ttl=30.0)
    bind_on(core, "w-s1", w1.lease_id)
    bind_on(core, "w-s2", w1.lease_id)
    call(core, "begin_close", session_key="w-s2")
    call(core, "open_named", name="chat-1", session_key="k1", lease=g1.lease_id, now=2.0)
    bind(core, "k1")
    call(core, "open_named", name="chat-2", session_key="k2", lease=g1.lease_id, now=2.0)
    call(core, "open_named", name="chat-3", session_key="k3", lease=g1.lease_id, now=2.0)
    bind(core, "k3")
    close(core, "k3")
    lease(core, W, "i2", now=3.0, ttl=10.0)  # releases w-s1, w-s2
    lease(core, G, "g2", now=4.0, ttl=30.0, on_restart="adopt")
    lease(core, "short", "1", now=4.0, ttl=1.0)
    call(core, "sweep", now=6.0, name_ttl=NAME_TTL)
    lease(core, "closer", "1", now=6.0)
    call(core, "close_lease", owner="closer", incarnation="1")
    r = call(core, "reserve", version_id="A", digest=digest_of("A"))
    _restart(core, E1, "inc-2")
    call(core, "record_ready", receipt=receipt(core, r, E1, "inc-2"))
    _restart(core, E0, "inc-2")


def test_a_snapshot_round_trip_with_leases_names_and_dead_leases_is_exact() -> None:
    core = new_core()
    _rich_scenario(core)
    image = registry_image(core)
    assert image["leases"]
    assert image["dead_leases"]
    assert image["names"]
    assert image["now"] == 6.0
    copy = new_core()
    copy.load_state(image)
    assert registry_image(copy) == image
    # And it behaves the same from here on.
    for c in (core, copy):
        assert call(c, "sweep", now=34.0, name_ttl=NAME_TTL, request_id="s") == SweepResult(
            ("gateway/g2", "worker/i2"), ("k1",), 0
        )
    assert registry_image(copy) == registry_image(core)
    with pytest.raises(LeaseExpiredError):
        call(copy, "open_lease", owner=W, incarnation="i1", ttl=1.0, now=40.0)
    with pytest.raises(SessionClosedError):
        call(copy, "open_named", name="chat-3", session_key="z", lease=None, now=40.0)


class Restartable:
    """A :class:`LocalRegistry` on one journal file and one injected clock, restarted at will.

    A restart closes the registry and opens a new one on the same journal: what the new one holds
    comes from the journal alone, so comparing images across it proves the replay exact.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.clock = FakeClock(0.0)
        self.options: dict[str, Any] = {}
        self.reg: LocalRegistry | None = None

    def open(self, **options: Any) -> LocalRegistry:
        """The first registry on the journal; ``options`` hold for every restart too."""
        self.options = options
        self.reg = LocalRegistry(
            engines=(E0, E1),
            capacity=2,
            journal_path=self.path,
            clock=self.clock,
            sweep_interval=None,
            name_ttl=NAME_TTL,
            **options,
        )
        return self.reg

    async def restart(self, at: float | None = None) -> LocalRegistry:
        """Close the registry; when ``at`` is given it was down until then; open it again."""
        assert self.reg is not None
        await self.reg.aclose()
        if at is not None:
            self.clock.t = at
        return self.open(**self.options)

    async def replays_exactly(self) -> dict[str, Any]:
        """Restart with the clock unmoved and prove the journal rebuilt the same image."""
        assert self.reg is not None
        image = registry_image(self.reg.core)
        assert registry_image((await self.restart()).core) == image
        return image


@pytest_asyncio.fixture
async def local(tmp_path: Path) -> AsyncIterator[Restartable]:
    registry = Restartable(tmp_path / "j.sqlite")
    yield registry
    if registry.reg is not None:
        await registry.reg.aclose()  # idempotent: a test may have closed it already


async def _publish_local(reg: LocalRegistry, version_id: str) -> None:
    await publish_by_verbs(reg, version_id, (E0, E1))


async def _local_scenario(reg: LocalRegistry, clock: FakeClock) -> None:
    rid = new_request_id
    await _publish_local(reg, "A")
    clock.t = 1.0
    w1 = await reg.open_lease(request_id=rid(), owner=W, incarnation="i1", ttl=10.0)
    g1 = await reg.open_lease(request_id="open-g1", owner=G, incarnation="g1", ttl=30.0)
    await reg.bind_first(request_id=rid(), session_key="w-s1", lease=w1.lease_id)
    clock.t = 2.0
    await reg.open_named(request_id=rid(), name="chat-1", session_key="k1", lease=g1.lease_id)
    await reg.bind_first(request_id=rid(), session_key="k1")
    await reg.open_named(request_id=rid(), name="chat-2", session_key="k2", lease=None)
    await reg.begin_close(request_id=rid(), session_key="k2")
    clock.t = 3.0
    await reg.open_lease(request_id=rid(), owner=W, incarnation="i2", ttl=10.0)
    await reg.open_lease(request_id=rid(), owner=G, incarnation="g2", ttl=30.0, on_restart="adopt")
    await reg.open_lease(request_id=rid(), owner="short", incarnation="1", ttl=1.0)
    clock.t = 5.0
    assert (await reg.sweep_if_due()) == SweepResult(("short/1",), (), 0)
    with pytest.raises(LeaseExpiredError):  # refused: not journaled, clock unmoved
        await reg.renew_lease(request_id=rid(), owner="short", incarnation="1")
    await reg.observe_incarnation(request_id=rid(), engine=E1, incarnation="inc-2")


@pytest.mark.asyncio
async def test_local_registry_stamps_timed_verbs_with_its_own_clock(local: Restartable) -> None:
    local.clock.t = 100.0
    reg = local.open()
    grant = await reg.open_lease(request_id="r1", owner=W, incarnation="i1", ttl=10.0)
    assert (grant.expires_at, reg.core.now) == (110.0, 100.0)
    assert await reg.sweep_if_due() is None  # not due: nothing journaled
    seq = reg.core.seq
    local.clock.t = 110.0
    assert (await reg.sweep_if_due()) == SweepResult(("worker/i1",), (), 0)
    assert reg.core.seq == seq + 1


@pytest.mark.asyncio
async def test_a_close_through_local_registry_dates_the_name_tombstone_itself(
    local: Restartable,
) -> None:
    reg = local.open()
    await reg.open_named(request_id=new_request_id(), name="chat-1", session_key="k1", lease=None)
    local.clock.t = 500.0  # no other timed call in between: only the close itself brings the time
    await reg.begin_close(request_id=new_request_id(), session_key="k1")
    assert registry_image(reg.core)["names"] == [["chat-1", "k1", None, 500.0, "closed"]]
    local.clock.t = 500.0 + NAME_TTL - 0.5
    assert await reg.sweep_if_due() is None
    local.clock.t = 500.0 + NAME_TTL
    assert await reg.sweep_if_due() == SweepResult((), (), 1)


@pytest.mark.asyncio
async def test_a_replay_through_local_registry_answers_the_original_even_after_a_restart(
    local: Restartable,
) -> None:
    reg = local.open()
    first = await reg.open_lease(request_id="open-1", owner=W, incarnation="i1", ttl=10.0)
    local.clock.t = 7.0
    again = await reg.open_lease(request_id="open-1", owner=W, incarnation="i1", ttl=10.0)
    assert again == first
    assert reg.core.now == 0.0  # the replay ran nothing, so it brought no time

    reg = await local.restart(at=8.0)
    late = await reg.open_lease(request_id="open-1", owner=W, incarnation="i1", ttl=10.0)
    assert late == first  # the journal remembers the answer; expires_at is the original 10.0
    # That replay was the first call after the restart: the lease grace ran before it.
    status = reg.core.lease("worker/i1")
    assert status is not None
    assert status.expires_at == 18.0


@pytest.mark.parametrize("compact_every", [50_000, 4])
@pytest.mark.asyncio
async def test_journal_replay_rebuilds_leases_names_and_the_clock_exactly(
    local: Restartable, compact_every: int
) -> None:
    reg = local.open(compact_every=compact_every)
    await _local_scenario(reg, local.clock)
    image = registry_image(reg.core)
    assert image["now"] == 5.0
    reg = await local.restart(at=500.0)  # the registry was down far longer than any TTL
    assert registry_image(reg.core) == image  # nothing ran yet: not even the lease grace


@pytest.mark.asyncio
async def test_the_first_call_after_a_restart_with_live_leases_resumes_them_once(
    local: Restartable,
) -> None:
    reg = local.open()
    await _local_scenario(reg, local.clock)
    live = {s.lease_id: s.ttl for s in reg.core.status().leases}
    assert set(live) == {"worker/i2", "gateway/g2"}

    reg = await local.restart(at=500.0)  # every deadline has passed while the registry was down
    seq = reg.core.seq
    # The expiry sweep is the first call: the grace runs before it, so nothing expires.
    # (Only the tombstone of chat-2, closed at 2.0, is old enough to be forgotten.)
    assert (await reg.sweep_if_due()) == SweepResult((), (), 1)
    assert reg.core.seq == seq + 2  # resume_leases, then the sweep
    assert reg.core.now == 500.0
    assert {s.lease_id: s.expires_at for s in reg.core.status().leases} == {
        lid: 500.0 + ttl for lid, ttl in live.items()
    }
    assert _state_of(reg.core, "k1") is SessionState.BOUND
    # Only once: the next call is just itself.
    local.clock.t = 501.0
    await reg.renew_lease(request_id=new_request_id(), owner=W, incarnation="i2")
    assert reg.core.seq == seq + 3
    # The grace itself was journaled: a further restart replays it exactly.
    await local.replays_exactly()


@pytest.mark.asyncio
async def test_a_restart_without_live_leases_runs_no_grace(local: Restartable) -> None:
    reg = local.open()
    await _publish_local(reg, "A")
    await reg.open_lease(request_id=new_request_id(), owner=W, incarnation="i1", ttl=10.0)
    await reg.close_lease(request_id=new_request_id(), owner=W, incarnation="i1")

    reg = await local.restart(at=50.0)
    seq = reg.core.seq
    await reg.bind_first(request_id=new_request_id(), session_key="s1")
    assert reg.core.seq == seq + 1
    assert reg.core.now == 0.0  # no timed verb ran


@pytest.mark.asyncio
async def test_the_grace_also_runs_before_a_first_call_that_is_refused(
    local: Restartable,
) -> None:
    reg = local.open()
    await reg.open_lease(request_id=new_request_id(), owner=W, incarnation="i1", ttl=10.0)

    reg = await local.restart(at=20.0)
    with pytest.raises(LeaseExpiredError):
        await reg.renew_lease(request_id=new_request_id(), owner=W, incarnation="other")
    status = reg.core.lease("worker/i1")
    assert status is not None
    assert status.expires_at == 30.0
    await local.replays_exactly()


@pytest.mark.asyncio
async def test_a_refused_timed_call_leaves_memory_and_journal_in_agreement(
    local: Restartable,
) -> None:
    # A refused call is not journaled. Had it moved the registry's clock, the tombstone made by a
    # later untimed step (here close_lease) would carry another time live than after a replay, and
    # the name would be forgotten at another moment by each.
    local.clock.t = 10.0
    reg = local.open()
    await reg.open_lease(request_id=new_request_id(), owner=G, incarnation="g1", ttl=100.0)
    await reg.open_named(
        request_id=new_request_id(), name="chat-1", session_key="k1", lease="gateway/g1"
    )
    local.clock.t = 50.0
    with pytest.raises(LeaseExpiredError):
        await reg.renew_lease(request_id=new_request_id(), owner=W, incarnation="never")
    with pytest.raises(InvalidStateError):
        await reg.open_named(
            request_id=new_request_id(), name="chat-2", session_key="k1", lease=None
        )
    assert reg.core.now == 10.0
    await reg.close_lease(request_id=new_request_id(), owner=G, incarnation="g1")
    image = await local.replays_exactly()
    assert image["names"] == [["chat-1", "k1", "gateway/g1", 10.0, "owner_closed"]]
