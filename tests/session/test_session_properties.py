"""Property test: whatever mix of publications, lost replies and failed releases a Session sees,
it sends one version for life, binds through one request id and releases exactly once."""

from __future__ import annotations

import asyncio
import contextlib

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from tenacity import wait_none

from agentic_lora.errors import NoPublishedVersionError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.session import SessionPhase
from tests.session_support import Harness
from tests.session_support import harness
from tests.session_support import publish

STEPS = st.sampled_from(
    [
        "generate",
        "generate",
        "publish",
        "lose_bind_reply",
        "fail_bind",
        "engine_lost_reply",
        "engine_503",
        "fail_release",
        "lose_release_reply",
        "close",
    ]
)


async def scenario(steps: list[str]) -> None:
    async with harness(registry_retry=RegistryRetry(attempts=2, wait=wait_none())) as h:
        await run(h, steps)


async def run(h: Harness, steps: list[str]) -> None:
    reg, eng = h.registry, h.engines
    s = h.versioning.open_session("S")
    published: list[str] = []
    lora_of: dict[str, str] = {}
    closed_from = None
    for step in steps:
        if step == "publish":
            if len(published) >= 2:
                # Keep within capacity 2: reclaim is not this test's subject.
                continue
            vid = f"V{len(published)}"
            lora_of[vid] = (await publish(reg, vid)).lora_name
            published.append(vid)
        elif step == "lose_bind_reply":
            reg.lose_reply["bind_first"] += 1
        elif step == "fail_bind":
            reg.fail_before["bind_first"] += 1
        elif step == "engine_lost_reply":
            eng.actions.append("lose")
        elif step == "engine_503":
            eng.actions.append(503)
        elif step == "fail_release":
            reg.fail_before["release"] += 1
        elif step == "lose_release_reply":
            reg.lose_reply["release"] += 1
        elif step == "generate":
            with contextlib.suppress(
                NoPublishedVersionError,
                RequestRefusedError,
                RequestIndeterminateError,
                SessionClosedError,
            ):
                await s.generate({"text": "turn"})
        elif step == "close":
            if closed_from is None:
                closed_from = len(eng.sent)
            with contextlib.suppress(SessionReleaseError):
                await s.close()

    # Heal every scripted fault, then close for good.
    reg.fail_before.clear()
    reg.lose_reply.clear()
    if closed_from is None:
        closed_from = len(eng.sent)
    result = await s.close()
    assert s.phase is SessionPhase.CLOSED

    sent_paths = {g.body["lora_path"] for g in eng.generations()}
    assert len(sent_paths) <= 1  # one version for the Session's whole life
    if sent_paths:
        assert s.binding is not None
        assert sent_paths == {s.binding.lora_name}
    assert len(eng.sent) == closed_from  # nothing was dispatched once close began
    assert len(set(reg.request_ids("bind_first"))) <= 1
    assert len(set(reg.request_ids("release"))) == 1
    assert result is not None
    for vid in published:
        status = reg.peek_version(vid)
        assert status is not None
        assert status.session_refs == 0  # released exactly once: never left held, never negative
    if result.version_id is not None:
        assert s.binding is None or s.binding.version_id == result.version_id
    assert (await reg.status()).live_sessions == 0


@settings(max_examples=60)  # no deadline, no too_slow check: the profile in tests/conftest.py
@given(steps=st.lists(STEPS, min_size=1, max_size=12))
def test_any_fault_schedule_keeps_one_version_and_releases_once(steps: list[str]) -> None:
    asyncio.run(scenario(steps))
