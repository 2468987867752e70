"""``RegistryCore.close_session_now`` is ``begin_close``, ``release`` and ``forget_sessions`` to
the letter: from every kind of Session record, the one step and the three verbs leave the same
registry image (refs, leases, names, tombstones, clock, sequence number) and give the same answers.
"""

from __future__ import annotations

import pytest

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import SessionStatus

from .util import bind
from .util import bind_on
from .util import call
from .util import lease
from .util import new_core
from .util import registry_image

NOW = 7.0


def _world() -> RegistryCore:
    """One Session record of every kind, bound to A, with leases and durable names."""
    core = new_core(published="A")
    live = lease(core, "gateway", "g1", now=0.0, ttl=100.0)
    short = lease(core, "worker", "w1", now=0.0, ttl=5.0)
    bind(core, "bound")
    bind_on(core, "leased", live.lease_id)
    call(core, "open_named", name="chat", session_key="named", lease=live.lease_id, now=1.0)
    bind(core, "named")
    call(core, "open_named", name="idle", session_key="named-unbound", lease=live.lease_id, now=1)
    for key in ("closing", "closed"):
        bind_on(core, key, live.lease_id)
        call(core, "begin_close", session_key=key)
    call(core, "release", session_key="closed")
    bind_on(core, "expired", short.lease_id)
    call(core, "sweep", now=6.0, name_ttl=100.0)
    return core


def _copy(core: RegistryCore) -> RegistryCore:
    twin = new_core()
    twin.load_state(core.to_state())
    return twin


def _by_verbs(core: RegistryCore, key: str) -> tuple[SessionStatus, ReleaseResult]:
    closing = core.apply("begin_close", {"session_key": key, "now": NOW})
    released = core.apply("release", {"session_key": key})
    assert core.apply("forget_sessions", {"session_keys": (key,)}) == 1
    return closing, released


KEYS = ("bound", "leased", "named", "named-unbound", "closing", "closed", "expired", "unknown")


@pytest.mark.parametrize("key", KEYS)
def test_close_session_now_equals_the_three_verbs(key: str) -> None:
    verbs = _world()
    one_step = _copy(verbs)
    assert registry_image(one_step) == registry_image(verbs)
    refs_before = verbs.version("A").session_refs
    expected = _by_verbs(verbs, key)
    assert one_step.close_session_now(key, NOW) == expected
    assert registry_image(one_step) == registry_image(verbs)
    assert one_step.session(key) is None
    # A Session that still held its ref gave back exactly one.
    holds = key in ("bound", "leased", "named", "closing")
    assert one_step.version("A").session_refs == refs_before - holds


def test_every_key_closed_in_turn_leaves_the_same_registry() -> None:
    verbs = _world()
    one_step = _copy(verbs)
    for key in KEYS:
        assert one_step.close_session_now(key, NOW) == _by_verbs(verbs, key)
    assert registry_image(one_step) == registry_image(verbs)
    assert verbs.version("A").session_refs == 0
    # Every name is a tombstone now: neither path can open it again.
    for core in (verbs, one_step):
        with pytest.raises(AgenticLoRAError):
            call(core, "bind_first", session_key="named")


def test_a_bad_now_is_refused_before_anything_changes() -> None:
    core = _world()
    before = registry_image(core)
    with pytest.raises(AgenticLoRAError):
        core.close_session_now("bound", float("nan"))
    assert registry_image(core) == before
