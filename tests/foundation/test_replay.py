"""Replaying idempotent calls: the retry policy is entered only after a first attempt failed."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from tenacity import AsyncRetrying
from tenacity import RetryCallState
from tenacity import stop_after_attempt
from tenacity import wait_none

import agentic_lora
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import SessionStateError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.foundation.replay import after_failure


class LostReply(ConnectionError):
    """What a dead actor or a dropped connection looks like to the caller."""


class Script:
    """A call answering from a script: an exception is raised, anything else returned."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self) -> object:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


@pytest.mark.asyncio
async def test_a_call_that_answers_never_builds_the_policy() -> None:
    built: list[AsyncRetrying] = []

    def policy() -> AsyncRetrying:
        built.append(AsyncRetrying(stop=stop_after_attempt(3), reraise=True))
        return built[-1]

    call = Script("ok")
    assert await after_failure(call, policy) == "ok"
    assert (call.calls, built) == (1, [])


@pytest.mark.asyncio
async def test_the_first_failure_is_the_policys_first_attempt() -> None:
    seen: list[int] = []

    def before_sleep(state: RetryCallState) -> None:
        seen.append(state.attempt_number)

    def policy() -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(3), wait=wait_none(), before_sleep=before_sleep, reraise=True
        )

    call = Script(LostReply("a"), LostReply("b"), "ok")
    assert await after_failure(call, policy) == "ok"
    # Three attempts in all, as a loop entered from the start would make: the plain first call
    # counts as attempt 1, so the stop bounds the total, not the replays.
    assert (call.calls, seen) == (3, [1, 2])
    exhausted = Script(LostReply("a"), LostReply("b"), LostReply("c"), "never")
    with pytest.raises(LostReply, match="c"):
        await after_failure(exhausted, policy)
    assert exhausted.calls == 3


@pytest.mark.asyncio
async def test_registry_replay_only_after_a_lost_reply_and_never_after_an_answer() -> None:
    retry = RegistryRetry(attempts=2, wait=wait_none())
    lost_once = Script(LostReply("dead actor"), "bound")
    assert await retry.call("bind_first", lost_once) == "bound"
    assert lost_once.calls == 2
    # A typed error is the registry's answer: never replayed.
    answered = Script(SessionStateError("closed"), "never")
    with pytest.raises(SessionStateError):
        await retry.call("bind_first", answered)
    assert answered.calls == 1


@pytest.mark.asyncio
async def test_a_cancelled_first_attempt_is_not_handed_to_the_policy() -> None:
    def policy() -> AsyncRetrying:
        raise AssertionError("the policy must not be entered")

    call = Script(asyncio.CancelledError(), "never")
    with pytest.raises(asyncio.CancelledError):
        await after_failure(call, policy)
    assert call.calls == 1


@pytest.mark.parametrize("attempts", [0, -1, True, 2.5, "3"])
def test_a_policy_without_a_whole_positive_number_of_attempts_is_refused(attempts: object) -> None:
    with pytest.raises(ConfigurationError) as err:
        RegistryRetry(attempts=attempts, wait=wait_none())  # type: ignore[arg-type]
    assert err.value.details["check"] == "registry_retry"


def test_a_policy_is_immutable_and_one_attempt_is_enough() -> None:
    once = RegistryRetry(attempts=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        once.attempts = 0  # type: ignore[misc]
    assert once.attempts == 1
    assert agentic_lora.RegistryRetry is RegistryRetry


@pytest.mark.asyncio
async def test_one_attempt_never_replays() -> None:
    lost = Script(LostReply("dead actor"), "never")
    with pytest.raises(LostReply):
        await RegistryRetry(attempts=1, wait=wait_none()).call("release", lost)
    assert lost.calls == 1
