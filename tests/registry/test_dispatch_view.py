"""The dispatch guard's read (``RegistryCore.dispatch_view``): the same state, name and ready
engines as ``peek_version``, through a version's whole life."""

from __future__ import annotations

from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import DispatchView
from agentic_lora.registry.types import Reservation
from tests.registry.util import E0
from tests.registry.util import E1
from tests.registry.util import call
from tests.registry.util import digest_of
from tests.registry.util import ready


def agrees(core: RegistryCore, version_id: str) -> DispatchView | None:
    view = core.dispatch_view(version_id)
    status = core.peek_version(version_id)
    if status is None:
        assert view is None
        return None
    assert view == DispatchView(status.state, status.lora_name, status.ready_engines)
    return view


def test_the_dispatch_view_agrees_with_the_status_in_every_state() -> None:
    core = RegistryCore(engines=(E0, E1), capacity=2)
    assert agrees(core, "A") is None
    r: Reservation = call(core, "reserve", version_id="A", digest=digest_of("A"))
    assert agrees(core, "A") == DispatchView(r.state, r.lora_name, ())
    ready(core, r, E1)
    assert agrees(core, "A") == DispatchView(r.state, r.lora_name, (E1,))
    ready(core, r, E1, E0)  # reported out of fleet order; read in fleet order
    assert agrees(core, "A") == DispatchView(r.state, r.lora_name, (E0, E1))
    call(core, "commit", version_id="A", attempt=r.attempt, expected_default_revision=0)
    published = agrees(core, "A")
    assert published is not None
    assert published.state.dispatchable
    # E1 restarted: it holds nothing until the version is loaded onto it again.
    call(core, "observe_incarnation", engine=E1, incarnation="inc-2")
    assert agrees(core, "A") == DispatchView(published.state, r.lora_name, (E0,))
    rb: Reservation = call(core, "reserve", version_id="B", digest=digest_of("B"))
    ready(core, rb, E0)
    ready(core, rb, E1, incarnation="inc-2")
    call(core, "commit", version_id="B", attempt=rb.attempt, expected_default_revision=1)
    retired = agrees(core, "A")
    assert retired is not None
    assert retired.state.dispatchable
    call(core, "claim_reclaim", version_id="A")
    reclaiming = agrees(core, "A")
    assert reclaiming is not None
    assert not reclaiming.state.dispatchable
