"""Idle Sessions: the expiry loop, Sessions closed elsewhere, a release that fails, and the
registry's memory of closed ids.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.gateway.sessions import IdleReaped
from agentic_lora.session import SessionPhase
from tests.gateway.test_gateway import FakeClock
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import gateway_stack

pytestmark = pytest.mark.asyncio


class ReadCountingClock(FakeClock):
    """A fake clock that also lets a test wait for its next reads (each reap round reads once)."""

    def __init__(self, fail_reads: int = 0) -> None:
        super().__init__()
        self.reads = 0
        self.fail_reads = fail_reads
        self._read = asyncio.Event()

    def __call__(self) -> float:
        self.reads += 1
        self._read.set()
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise OSError("clock source unavailable")
        return self.now

    async def reads_after(self, count: int) -> None:
        target = self.reads + count
        while self.reads < target:
            self._read.clear()
            await self._read.wait()


async def test_the_expiry_loop_closes_idle_sessions_and_survives_a_failed_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ReadCountingClock()
    # idle_timeout only paces the loop here; idleness is measured on the fake clock.
    async with gateway_stack(tmp_path, clock=clock, idle_timeout=0.004, published="A") as stack:
        await chat(stack.agent("sleepy"))
        await clock.reads_after(2)  # the loop runs, and the Session is not idle yet
        assert stack.gateway.versioning.get("sleepy") is not None

        clock.fail_reads = 1
        clock.now = 10.0
        with caplog.at_level(logging.ERROR, logger="agentic_lora.gateway.app"):
            # The failing round, then one whole round after it.
            await clock.reads_after(3)
        assert [r.getMessage() for r in caplog.records] == [
            "idle Session expiry failed; retried next round"
        ]
        assert stack.gateway.versioning.get("sleepy") is None
        assert stack.gateway.sessions.live() == 0
        version = stack.gateway.deployment.registry.peek_version("A")  # type: ignore[attr-defined]
        assert version.session_refs == 0

        refused = await stack.http().post(
            "/generate", json={"text": "x"}, headers={"authorization": "Bearer sleepy"}
        )
        assert refused.status_code == 409
        # The registry tombstoned the id: the same answer on every replica and after a restart.
        assert refused.json()["error"]["details"] == {"session": "sleepy", "reason": "closed"}


async def test_reap_forgets_sessions_closed_elsewhere(tmp_path: Path) -> None:
    clock = FakeClock()
    async with gateway_stack(tmp_path, clock=clock, published="A") as stack:
        await chat(stack.agent("via-http"))
        assert stack.gateway.sessions.live() == 1
        # The Python API closes it, not the gateway.
        result = await stack.gateway.versioning.close_session("via-http")
        assert result is not None
        assert result.released_now
        clock.now = 1000.0
        assert await stack.gateway.sessions.reap_idle(1.0) == IdleReaped()
        assert stack.gateway.sessions.live() == 0


async def test_an_idle_close_whose_release_fails_keeps_the_session_and_refuses_its_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    # The registry becomes unavailable (closed under the gateway): no release can be confirmed,
    # and the shutdown reports the Session it could not release.
    stack_context = gateway_stack(tmp_path, clock=clock)
    stack = await stack_context.__aenter__()
    try:
        await stack.publish("A", 1)
        await chat(stack.agent("stuck"))
        registry: Any = stack.gateway.deployment.registry
        await registry.aclose()
        clock.now = 1000.0
        with caplog.at_level(logging.WARNING, logger="agentic_lora.gateway.sessions"):
            assert await stack.gateway.sessions.reap_idle(1.0) == IdleReaped()
        (record,) = [r for r in caplog.records if r.name == "agentic_lora.gateway.sessions"]
        assert record.getMessage() == "idle Session close not confirmed; retried next round"
        assert getattr(record, "error") == "SESSION_RELEASE_FAILED"  # noqa: B009
        session = stack.gateway.versioning.get("stuck")
        assert session is not None
        assert session.phase is SessionPhase.FINALIZING
        assert stack.gateway.sessions.live() == 1
        # Its id is already refused: no straggler can open a fresh binding meanwhile.
        refused = await stack.http().post(
            "/generate", json={"text": "x"}, headers={"authorization": "Bearer stuck"}
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "SESSION_CLOSED"
        assert len(stack.routes.sent) == 1
    finally:
        # Shutting down reports the Session it could not release instead of dropping it.
        with pytest.raises(SessionReleaseError):
            await stack_context.__aexit__(None, None, None)


async def test_closed_ids_are_remembered_by_the_registry_none_forgotten_by_count(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        sessions = stack.gateway.sessions
        for session_id in ("first", "second", "third"):
            await sessions.open(session_id)
            await sessions.close(session_id)
        # The gateway keeps nothing of them; the registry keeps every one (until name_ttl).
        assert sessions.live() == 0
        for session_id in ("first", "second", "third"):
            with pytest.raises(AgenticLoRAError) as err:
                await sessions.open(session_id)
            assert err.value.code == "SESSION_CLOSED"
            assert err.value.details == {"session": session_id, "reason": "closed"}
