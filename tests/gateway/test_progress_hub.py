"""The gateway's progress fan-out: each listener hears its own publication, and a broken or
leaving listener starves no one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from agentic_lora.gateway.progress import ProgressHub
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PhaseStatus


def event(engine: str | None, phase: Phase = Phase.PREPARE) -> PhaseEvent:
    return PhaseEvent(engine=engine, phase=phase, status=PhaseStatus.DONE, version_id="A")


def test_a_listener_hears_only_its_block_and_a_broken_one_starves_no_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = ProgressHub()
    heard: list[PhaseEvent] = []
    always: list[PhaseEvent] = []

    def broken(_: PhaseEvent) -> None:
        raise RuntimeError("listener bug")

    hub.subscribe(broken)
    unsubscribe = hub.subscribe(always.append)
    with caplog.at_level(logging.ERROR, logger="agentic_lora.gateway.progress"):
        hub(event("e0"))
        with hub.listening(heard.append):
            assert len(hub) == 3
            hub(event("e1"))
        hub(event(None, Phase.COMMIT))
    assert heard == [event("e1")]
    assert always == [event("e0"), event("e1"), event(None, Phase.COMMIT)]
    assert len(hub) == 2
    assert [(r.getMessage(), getattr(r, "engine")) for r in caplog.records] == [  # noqa: B009
        ("progress listener failed", "e0"),
        ("progress listener failed", "e1"),
        ("progress listener failed", None),
    ]
    unsubscribe()
    unsubscribe()  # idempotent
    assert len(hub) == 1


def test_a_listener_may_unsubscribe_while_it_is_being_called() -> None:
    hub = ProgressHub()
    calls: list[str] = []
    unsubscribe: Callable[[], None] = lambda: None  # noqa: E731

    def once(e: PhaseEvent) -> None:
        calls.append(f"once {e.engine}")
        unsubscribe()

    unsubscribe = hub.subscribe(once)
    hub.subscribe(lambda e: calls.append(f"always {e.engine}"))
    hub(event("e0"))
    hub(event("e1"))
    assert calls == ["once e0", "always e0", "always e1"]
