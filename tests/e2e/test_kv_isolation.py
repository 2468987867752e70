"""Rules 7.2-2 and 7.2-3, KV isolation: versions share no prefix-cache entries, cache on, no flush.

Two experiments, each from its own initial cache state (each test publishes its own fresh
versions, so every engine-local lora id, and with it every KV namespace, starts empty):

* A-warm then B: on engine X a Session bound to A sends prompt Q (twice: the second is a cache
  hit, so A's KV for Q really is there). A Session bound to B then sends Q on X: it reports 0
  cached tokens and reproduces the B cold baseline (the same request on engine Y, where Q was
  never sent). B repeating Q on X hits B's own cache and still reproduces the baseline.
* the mirror: B-warm then A, with X and Y swapped, so both engines are covered.

Every request goes through the product (Sessions, pinning, routing); nothing is flushed: the
recording proxies show no flush, pause or abort-all (checked for every test in teardown) and
the engines' own access logs show no flush either.
"""

from __future__ import annotations

import pytest

from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.session import Session
from tests.e2e.conftest import Stack
from tests.e2e.support import Scored
from tests.e2e.support import fresh_id
from tests.e2e.support import scored

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_NEW_TOKENS = 8


async def _send(session: Session, engine: str, prompt: list[int]) -> Scored:
    # No logprob_start_len: SGLang may then reuse cached prefix KV for this request.
    reply = await session.generate(
        {
            "input_ids": prompt,
            "rid": fresh_id("kv"),
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0},
        }
    )
    assert reply.engine == engine
    return scored(reply.body)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("warm", "probe", "engine", "cold_engine"),
    [("A", "B", "E0", "E1"), ("B", "A", "E1", "E0")],
    ids=["A-warm-then-B-on-E0", "B-warm-then-A-on-E1"],
)
async def test_a_warm_cache_of_one_version_is_invisible_to_another(
    stack: Stack, warm: str, probe: str, engine: str, cold_engine: str
) -> None:
    sessions: dict[tuple[str, str], Session] = {}
    for letter in ("A", "B"):
        result = await stack.publish(letter)
        assert result.outcome is PublicationOutcome.PUBLISHED
        for where in stack.engine_names:
            session = await stack.open_on(where, f"kv-{letter}-{where}")
            # The first generation binds the Session (to the default just published).
            await _send(session, where, stack.chat.first_turn("hello"))
            binding = session.binding
            assert binding is not None
            assert binding.version_id == stack.versions[letter]
            sessions[letter, where] = session

    # Q starts with words no binding prompt starts with, so no namespace has any of it cached.
    words = " ".join(["the agent will call the weather tool and then answer"] * 6)
    prompt = stack.chat.encode(f"kv isolation {fresh_id('q')} {words}")
    assert len(prompt) > 60
    logs_since = {name: log.offset() for name, log in stack.logs.items()}

    cold = await _send(sessions[probe, cold_engine], cold_engine, prompt)
    assert cold.cached_tokens == 0

    warmed = await _send(sessions[warm, engine], engine, prompt)
    assert warmed.cached_tokens == 0
    warm_hit = await _send(sessions[warm, engine], engine, prompt)
    assert warm_hit.cached_tokens >= len(prompt) - 1  # the warm version's KV for Q is there
    assert warm_hit.output_ids == warmed.output_ids
    assert warmed.output_logprobs != cold.output_logprobs  # sharing KV would be visible

    after_warm = await _send(sessions[probe, engine], engine, prompt)
    assert after_warm.cached_tokens == 0
    assert after_warm.output_ids == cold.output_ids
    assert after_warm.output_logprobs == cold.output_logprobs

    own_hit = await _send(sessions[probe, engine], engine, prompt)
    assert own_hit.cached_tokens >= len(prompt) - 1
    assert own_hit.output_ids == cold.output_ids
    assert own_hit.output_logprobs == cold.output_logprobs

    for name, log in stack.logs.items():
        paths = {path for _, path in log.requests(since=logs_since[name])}
        assert "/flush_cache" not in paths, name
        assert "/generate" in paths, name  # the access log is really being read
