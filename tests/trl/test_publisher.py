"""The trainer hook: off-thread, coalescing publication; failures raised at the end; capacity.

Every wait is a gate: an engine call held on an ``asyncio.Event`` on the bridge's loop, or a
product hook (``on_capacity_wait``) telling the test thread the worker started waiting.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from agentic_lora_trl import AdapterPublisher
from agentic_lora_trl import BridgeClosedError
from agentic_lora_trl import DeploymentThread
from agentic_lora_trl import PublicationFailedError
from agentic_lora_trl import PublishCallback
from tenacity import wait_fixed
from transformers import TrainingArguments

from agentic_lora import Session
from agentic_lora import VersionState
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.scripted_engine import EngineOp
from agentic_lora.testing.scripted_engine import Fault
from agentic_lora.testing.scripted_engine import FaultKind
from tests.trl.support import GUARD_SECONDS
from tests.trl.support import Signal
from tests.trl.support import TinyPeft
from tests.trl.support import bridge_on
from tests.trl.support import digest_of
from tests.trl.support import loop_event
from tests.trl.support import registry_of
from tests.trl.support import set_on_loop
from tests.trl.support import trainer_state
from tests.trl.support import wait_on_loop
from tests.trl.support import weights

#: A capacity wait that only a freed slot, a newer submission or a stop can end.
NEVER_BY_TIMER = wait_fixed(3600)


@pytest.fixture
def args(tmp_path: Path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)


def _published(thread: DeploymentThread, version_id: str) -> VersionState:
    status = registry_of(thread).peek_version(version_id)
    assert status is not None, f"{version_id} was never reserved"
    return status.state


def _default(thread: DeploymentThread) -> str | None:
    return thread.run(thread.deployment.status()).default_version


def _hold_next_load(thread: DeploymentThread, fleet: ScriptedFleet, engine: str = "e0"):
    """Hold ``engine``'s next adapter load; returns (reached, gate), both loop events."""
    reached, gate = loop_event(thread), loop_event(thread)
    fleet[engine].script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
    return reached, gate


async def _bound_session(thread: DeploymentThread, name: str) -> Session:
    """A Session bound to the current default (one generation), left open."""
    session = thread.deployment.versioning.open_session(name)
    await session.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    return session


# --- off the training thread ----------------------------------------------------------------


def test_on_step_end_returns_while_the_engines_hold_the_publication_and_publishes_step_n_exactly(
    bridge: DeploymentThread, fleet: ScriptedFleet, args: TrainingArguments
) -> None:
    peft = TinyPeft()
    callback = PublishCallback(bridge, publish_every=1)
    state, control = trainer_state(0)
    callback.on_train_begin(args, state, control, model=peft.model)
    assert _default(bridge) == "step-0"

    peft.step()
    step_one = peft.digest()
    reached, gate = _hold_next_load(bridge, fleet)
    state.global_step = 1
    callback.on_step_end(args, state, control, model=peft.model)
    # Returned while the publication of step 1 waits inside an engine's load.
    wait_on_loop(bridge, reached)
    assert callback.stats.published == 1
    assert _default(bridge) == "step-0"
    # The optimizer moves on before the engines finish: the version must still be step 1's.
    peft.step()
    set_on_loop(bridge, gate)
    assert callback.publisher.flush(GUARD_SECONDS)
    assert _default(bridge) == "step-1"
    status = registry_of(bridge).peek_version("step-1")
    assert status is not None
    assert status.digest == step_one != peft.digest()


def test_only_every_nth_step_publishes_and_the_last_step_is_published_at_train_end(
    bridge: DeploymentThread, args: TrainingArguments
) -> None:
    peft = TinyPeft()
    callback = PublishCallback(bridge, publish_every=2, version_prefix="run7")
    state, control = trainer_state(0)
    callback.on_train_begin(args, state, control, model=peft.model)
    for step in (1, 2, 3):
        peft.step()
        state.global_step = step
        callback.on_step_end(args, state, control, model=peft.model)
        callback.publisher.flush(GUARD_SECONDS)
    callback.on_train_end(args, state, control, model=peft.model)
    versions = {v.version_id for v in bridge.run(bridge.deployment.status()).versions}
    assert versions == {"run7-0", "run7-2", "run7-3"}
    assert _default(bridge) == "run7-3"
    assert callback.stats.last_published_step == 3


# --- coalescing -------------------------------------------------------------------------------


def test_submissions_during_a_publication_coalesce_and_the_latest_wins(
    bridge: DeploymentThread, fleet: ScriptedFleet
) -> None:
    publisher = AdapterPublisher(bridge)
    publisher.submit(weights(0))
    assert publisher.flush(GUARD_SECONDS)
    reached, gate = _hold_next_load(bridge, fleet)
    publisher.submit(weights(1))
    wait_on_loop(bridge, reached)
    for step in (2, 3, 4):
        publisher.submit(weights(step))
    assert publisher.stats.coalesced == 2  # 2 replaced by 3, 3 by 4: one waits, never more
    set_on_loop(bridge, gate)
    assert publisher.flush(GUARD_SECONDS)
    stats = publisher.stats
    assert (stats.submitted, stats.published, stats.coalesced) == (5, 3, 2)
    assert _default(bridge) == "step-4"
    registry = registry_of(bridge)
    assert registry.peek_version("step-2") is None
    assert registry.peek_version("step-3") is None
    assert registry.peek_version("step-4").digest == digest_of(4)  # type: ignore[union-attr]
    assert publisher.failures == ()


# --- failures ---------------------------------------------------------------------------------


def test_a_failed_publication_is_logged_counted_and_raised_at_train_end(
    bridge: DeploymentThread,
    fleet: ScriptedFleet,
    args: TrainingArguments,
    caplog: pytest.LogCaptureFixture,
) -> None:
    peft = TinyPeft()
    callback = PublishCallback(bridge)
    state, control = trainer_state(0)
    callback.on_train_begin(args, state, control, model=peft.model)
    fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room for this adapter"))
    with caplog.at_level(logging.ERROR, logger="agentic_lora_trl.publishing"):
        for step in (1, 2):
            peft.step()
            state.global_step = step
            callback.on_step_end(args, state, control, model=peft.model)
            callback.publisher.flush(GUARD_SECONDS)
    assert _published(bridge, "step-1") is VersionState.FAILED_CLEAN
    assert _default(bridge) == "step-2"  # training went on, and so did publication
    stats = callback.stats
    assert (stats.failed, stats.published, stats.last_published_step) == (1, 2, 2)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert (record.step, record.version, record.code) == (1, "step-1", "FAILED_CLEAN")  # type: ignore[attr-defined]
    logs: dict[str, float] = {}
    callback.on_log(args, state, control, logs=logs)
    assert logs["agentic_lora/publication_failures"] == 1.0
    assert logs["agentic_lora/published_step"] == 2.0

    with pytest.raises(PublicationFailedError) as raised:
        callback.on_train_end(args, state, control, model=peft.model)
    assert raised.value.code == "TRL_PUBLICATION_FAILED"
    [failure] = raised.value.details["failures"]
    assert failure["step"] == 1
    assert failure["code"] == "FAILED_CLEAN"
    assert "e1" in failure["message"]


def test_a_publication_that_raises_is_a_failure_too(bridge: DeploymentThread) -> None:
    publisher = AdapterPublisher(bridge)
    publisher.submit(weights(0))
    publisher.flush(GUARD_SECONDS)
    publisher.submit(weights(0, seed=99))  # same version id, other content
    publisher.flush(GUARD_SECONDS)
    [failure] = publisher.failures
    assert (failure.step, failure.code) == (0, "VERSION_CONFLICT")
    with pytest.raises(PublicationFailedError):
        publisher.raise_for(0, when="the test")


def test_weights_that_cannot_make_a_snapshot_are_a_failure(bridge: DeploymentThread) -> None:
    publisher = AdapterPublisher(bridge)
    broken = weights(0)
    broken = type(broken)(broken.step, broken.version_id, broken.tensors, {"peft_type": "LORA"})
    publisher.submit(broken)
    publisher.flush(GUARD_SECONDS)
    [failure] = publisher.failures
    assert failure.code == "INVALID_ADAPTER"
    assert bridge.run(bridge.deployment.status()).versions == ()


def test_a_first_publication_that_fails_stops_training_at_train_begin(
    bridge: DeploymentThread, fleet: ScriptedFleet, args: TrainingArguments
) -> None:
    fleet["e0"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "engine full"))
    callback = PublishCallback(bridge)
    state, control = trainer_state(0)
    with pytest.raises(PublicationFailedError, match="train begin"):
        callback.on_train_begin(args, state, control, model=TinyPeft().model)
    assert _default(bridge) is None


def test_a_model_without_a_lora_adapter_is_refused_on_the_training_thread(
    bridge: DeploymentThread, args: TrainingArguments
) -> None:
    callback = PublishCallback(bridge)
    state, control = trainer_state(0)
    with pytest.raises(InvalidAdapterError, match="not a PEFT model"):
        callback.on_train_begin(args, state, control, model=object())
    assert callback.stats.submitted == 0


# --- capacity ---------------------------------------------------------------------------------


def _old_version_held(
    thread: DeploymentThread, **options: Any
) -> tuple[AdapterPublisher, Signal, Session]:
    """A publisher (``options``) with a capacity-wait listener, after step-0 was published, a
    Session bound to it, and step-1 published: step-0 is RETIRED and held, both slots taken."""
    publisher = AdapterPublisher(thread, **options)
    waits = Signal()
    publisher.on_capacity_wait.append(waits)
    publisher.submit(weights(0))
    publisher.flush(GUARD_SECONDS)
    session = thread.run(_bound_session(thread, "holds-step-0"))
    publisher.submit(weights(1))
    publisher.flush(GUARD_SECONDS)
    assert _published(thread, "step-0") is VersionState.RETIRED
    return publisher, waits, session


def test_a_capacity_refusal_is_retried_as_soon_as_the_held_version_is_reclaimed(
    bridge: DeploymentThread,
) -> None:
    publisher, waits, session = _old_version_held(bridge, capacity_wait=NEVER_BY_TIMER)

    publisher.submit(weights(2))
    waits.wait(1)  # reserve refused for capacity after a reclaim round: step-0 is still held
    assert waits.calls[0][0].step == 2
    assert waits.calls[0][1] == 1
    assert registry_of(bridge).peek_version("step-2") is None
    bridge.run(session.close())  # the reclaimer unloads step-0; the worker tries again at once
    assert publisher.flush(GUARD_SECONDS)
    assert _default(bridge) == "step-2"
    assert _published(bridge, "step-0") is VersionState.RECLAIMED
    stats = publisher.stats
    assert (stats.capacity_retries, stats.skipped, stats.failed) == (1, 0, 0)


def test_a_newer_submission_ends_a_capacity_wait_and_replaces_the_waiting_weights(
    bridge: DeploymentThread,
) -> None:
    publisher, waits, session = _old_version_held(bridge, capacity_wait=NEVER_BY_TIMER)

    publisher.submit(weights(2))
    waits.wait(1)
    publisher.submit(weights(3))
    waits.wait(2)  # step 2 given up; step 3 refused for capacity in its turn
    assert [(c[0].step, c[1]) for c in waits.calls] == [(2, 1), (3, 1)]
    bridge.run(session.close())
    assert publisher.flush(GUARD_SECONDS)
    assert _default(bridge) == "step-3"
    assert registry_of(bridge).peek_version("step-2") is None
    assert publisher.stats.coalesced == 1


def test_capacity_retries_are_bounded_and_an_unpublished_final_step_is_raised(
    bridge: DeploymentThread, caplog: pytest.LogCaptureFixture
) -> None:
    publisher, _, session = _old_version_held(
        bridge, capacity_retries=2, capacity_wait=wait_fixed(0)
    )
    with caplog.at_level(logging.WARNING, logger="agentic_lora_trl.publishing"):
        publisher.submit(weights(2))
        assert publisher.flush(GUARD_SECONDS)
    stats = publisher.stats
    assert (stats.capacity_retries, stats.skipped, stats.failed) == (2, 1, 0)
    assert _default(bridge) == "step-1"
    assert any("no free version slot after 2 retries" in r.getMessage() for r in caplog.records)
    with pytest.raises(PublicationFailedError) as raised:
        publisher.raise_for(2, when="train end")
    assert raised.value.details["last_published_step"] == 1
    assert raised.value.details["skipped"] == 1
    bridge.run(session.close())


def test_closing_the_bridge_during_a_capacity_wait_drops_the_weights_and_stops_the_worker(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    bridge = bridge_on(fleet, tmp_path)
    publisher, waits, _ = _old_version_held(bridge, capacity_wait=NEVER_BY_TIMER)
    publisher.submit(weights(2))
    waits.wait(1)
    bridge.close()  # would hang if the worker kept waiting for a slot
    assert publisher.stats.published == 2
    with pytest.raises(BridgeClosedError):
        publisher.submit(weights(3))


def test_a_fault_of_the_worker_itself_is_a_failure_and_the_worker_keeps_publishing(
    bridge: DeploymentThread,
) -> None:
    def broken_wait(retry_state: object) -> float:
        raise ZeroDivisionError("a wait strategy that breaks")

    publisher, _, session = _old_version_held(bridge, capacity_wait=broken_wait)
    publisher.submit(weights(2))  # refused for capacity: the broken strategy is asked for a wait
    assert publisher.flush(GUARD_SECONDS)
    [failure] = publisher.failures
    assert (failure.step, failure.code) == (2, "ZeroDivisionError")
    bridge.run(session.close())
    publisher.submit(weights(3))
    assert publisher.flush(GUARD_SECONDS)
    assert _default(bridge) == "step-3"
