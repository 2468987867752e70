"""The bridge between the trainer's thread and the Deployment's event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest
from agentic_lora_trl import BridgeClosedError
from agentic_lora_trl import BridgeState
from agentic_lora_trl import DeploymentThread

from agentic_lora import Deployment
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import VersionConflictError
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from tests.trl.support import GUARD_SECONDS
from tests.trl.support import bridge_on
from tests.trl.support import loop_event
from tests.trl.support import registry_of
from tests.trl.support import set_on_loop
from tests.trl.support import wait_on_loop


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_run_returns_the_result_and_raises_the_typed_error_of_the_coroutine(
    bridge: DeploymentThread,
) -> None:
    deployment = bridge.deployment
    result = bridge.run(deployment.publish("v1", tiny_snapshot(1)))
    assert result.ok
    assert bridge.run(deployment.status()).default_version == "v1"
    with pytest.raises(VersionConflictError):
        bridge.run(deployment.publish("v1", tiny_snapshot(2)))


def test_every_coroutine_runs_on_the_bridge_thread_never_the_callers(
    bridge: DeploymentThread,
) -> None:
    async def where() -> threading.Thread:
        return threading.current_thread()

    assert bridge.run(where()) is bridge.thread
    assert bridge.thread is not threading.current_thread()
    assert not bridge.in_loop_thread()


def test_run_on_the_bridges_own_thread_raises_instead_of_waiting_for_itself(
    bridge: DeploymentThread,
) -> None:
    async def nested() -> None:
        async def inner() -> int:
            return 1

        bridge.run(inner())

    with pytest.raises(RuntimeError, match="own loop"):
        bridge.run(nested())


def test_close_cancels_submitted_work_closes_its_sessions_and_leaves_no_thread(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    before = _threads()
    bridge = bridge_on(fleet, tmp_path)
    bridge.run(bridge.deployment.publish("v1", tiny_snapshot(1)))
    started = loop_event(bridge)
    never = loop_event(bridge)
    ended: list[str] = []

    async def episode() -> None:
        async with bridge.deployment.session("episode") as session:
            await session.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
            started.set()
            try:
                await never.wait()
            finally:
                ended.append(session.phase.value)
                # Offloaded work of the loop's executor must be gone after close too.
                await asyncio.to_thread(lambda: None)

    future = bridge.submit(episode())
    wait_on_loop(bridge, started)
    registry = registry_of(bridge)
    assert registry.peek_version("v1").session_refs == 1  # type: ignore[union-attr]
    bridge.close()
    assert future.cancelled()
    assert ended == ["BOUND"]
    # The Session was closed on the way out: its reference released before the registry closed.
    assert registry.peek_version("v1").session_refs == 0  # type: ignore[union-attr]
    assert bridge.state is BridgeState.CLOSED
    thread = bridge.thread
    assert thread is not None
    assert not thread.is_alive()
    assert _threads() <= before


def test_after_close_nothing_is_scheduled_and_the_coroutine_is_closed_unstarted(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    bridge = bridge_on(fleet, tmp_path)
    bridge.close()
    bridge.close()  # idempotent
    ran: list[int] = []

    async def work() -> None:
        ran.append(1)

    coroutine = work()
    with pytest.raises(BridgeClosedError) as refused:
        bridge.submit(coroutine)
    assert refused.value.code == "TRL_BRIDGE_CLOSED"
    assert coroutine.cr_frame is None  # closed: never awaited, never warned about
    with pytest.raises(BridgeClosedError):
        bridge.run(work())
    with pytest.raises(BridgeClosedError):
        _ = bridge.deployment
    assert ran == []


def test_a_run_waiting_when_the_bridge_closes_gets_bridge_closed(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    bridge = bridge_on(fleet, tmp_path)
    started = loop_event(bridge)
    never = loop_event(bridge)

    async def wait_forever() -> None:
        started.set()
        await never.wait()

    outcome: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()

    def caller() -> None:
        try:
            bridge.run(wait_forever())
        except BaseException as exc:
            outcome.set_result(exc)
        else:
            outcome.set_result(None)

    worker = threading.Thread(target=caller)
    worker.start()
    wait_on_loop(bridge, started)
    bridge.close()
    worker.join(GUARD_SECONDS)
    assert isinstance(outcome.result(0), BridgeClosedError)


def test_run_with_a_timeout_cancels_the_coroutine(bridge: DeploymentThread) -> None:
    never = loop_event(bridge)
    finished = loop_event(bridge)

    async def wait_forever() -> None:
        try:
            await never.wait()
        finally:
            finished.set()

    with pytest.raises(TimeoutError):
        bridge.run(wait_forever(), timeout=0.01)
    wait_on_loop(bridge, finished)  # cancelled, and its finally ran
    set_on_loop(bridge, never)


def test_a_deployment_that_cannot_be_built_leaves_nothing_running() -> None:
    before = _threads()

    def build() -> Deployment:
        raise ConfigurationError("no engines", check="engines")

    bridge = DeploymentThread(build)
    with pytest.raises(ConfigurationError):
        bridge.start()
    assert bridge.state is BridgeState.CLOSED
    assert _threads() <= before
    with pytest.raises(BridgeClosedError):
        bridge.start()
    bridge.close()


def test_a_bridge_never_started_closes_without_a_thread() -> None:
    bridge = DeploymentThread(lambda: pytest.fail("never built"))
    bridge.close()
    assert bridge.state is BridgeState.CLOSED
    assert bridge.thread is None


def test_closers_run_before_the_deployment_closes_newest_first(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    bridge = bridge_on(fleet, tmp_path)
    order: list[str] = []

    def closer(name: str):
        async def close() -> None:
            # The Deployment is still open: a closer may still publish or close Sessions.
            await bridge.deployment.status()
            order.append(name)

        return close

    bridge.on_close(closer("first"))
    bridge.on_close(closer("second"))
    bridge.close()
    assert order == ["second", "first"]


def test_a_failing_closer_is_raised_after_everything_stopped(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    bridge = bridge_on(fleet, tmp_path)
    later: list[str] = []

    async def broken() -> None:
        raise ValueError("closer broke")

    async def fine() -> None:
        later.append("ran")

    bridge.on_close(fine)
    bridge.on_close(broken)
    with pytest.raises(ValueError, match="closer broke"):
        bridge.close()
    assert later == ["ran"]
    assert bridge.state is BridgeState.CLOSED
    assert bridge.thread is not None
    assert not bridge.thread.is_alive()


def test_a_with_block_starts_a_new_bridge_or_takes_a_running_one_and_closes_it(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    running = bridge_on(fleet, tmp_path / "running")
    with running as same:
        assert same is running
        assert running.state is BridgeState.RUNNING
    assert running.state is BridgeState.CLOSED
    fresh = DeploymentThread.from_settings(
        fleet.settings(), backend_options={"store_root": str(tmp_path / "fresh")}
    )
    with fresh:
        assert fresh.state is BridgeState.RUNNING
    assert fresh.state is BridgeState.CLOSED
