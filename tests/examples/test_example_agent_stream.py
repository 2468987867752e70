"""The example agent with ``stream=True``: every turn is streamed through Session.stream (each
chunk naming its version) and assembled into the reply a non-streamed turn would have had.

The scripted chat of ``tests/examples/test_example_agent.py`` answers a streamed request with the same
completion, cut into OpenAI chunks (:class:`~agentic_lora.testing.streams.ScriptedStream`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentic_lora_agent import AttemptOutcome
from agentic_lora_agent import EpisodeStatus
from agentic_lora_agent import ScriptedPolicy
from agentic_lora_agent import ToolAgent
from agentic_lora_agent import default_toolbox

from agentic_lora.testing.streams import ScriptedStream
from agentic_lora.testing.streams import stream_reply
from tests.examples.test_example_agent import OSLO
from tests.examples.test_example_agent import SHORT
from tests.examples.test_example_agent import ScriptedChat
from tests.examples.test_example_agent import world


def as_chunks(completion: dict[str, Any]) -> list[dict[str, Any]]:
    """``completion`` (a chat completion body) as the chunks an engine streams it in."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {"id": completion["id"], "object": "chat.completion.chunk", "model": completion["model"]}
    chunks = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": message["content"][:3]},
                    "logprobs": {"content": choice["logprobs"]["content"][:1]},
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "content": message["content"][3:],
                        "tool_calls": [
                            {"index": i, **call}
                            for i, call in enumerate(message.get("tool_calls") or [])
                        ],
                    },
                    "logprobs": {"content": choice["logprobs"]["content"][1:]},
                    "finish_reason": choice["finish_reason"],
                }
            ],
        },
        {**head, "choices": [], "usage": completion["usage"]},
    ]
    return chunks


class StreamingChat(ScriptedChat):
    async def _chat(self, engine: str, request: httpx.Request) -> httpx.Response:
        answer = await super()._chat(engine, request)
        if not json.loads(request.content).get("stream"):
            return answer
        return stream_reply(ScriptedStream(as_chunks(answer.json())))


@pytest.mark.asyncio
async def test_a_streamed_episode_answers_like_a_whole_one_on_one_version(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        chat = StreamingChat()
        chat.mount(w.fleet)
        async with w.deployment.session("streamed") as s:
            agent = ToolAgent(
                s,
                OSLO,
                tools=default_toolbox(),
                config=dataclasses.replace(SHORT, stream=True),
                policy=ScriptedPolicy(),
            )
            episode = await agent.run()

    assert episode.status is EpisodeStatus.ANSWERED
    assert episode.observations == ("391", "709037", OSLO.expected_answer)
    assert episode.answer == "noise noise noise"
    bodies = chat.bodies()
    assert len(bodies) == 4
    assert all(b["stream"] is True for b in bodies)
    assert {b["model"] for b in bodies} == {f"tiny-qwen3:{w.a_name}"}
    for record in episode.attempts:
        assert record.outcome is AttemptOutcome.OK
        assert record.lora_name == w.a_name
        assert record.token_logprobs == (-0.25, -0.5, -0.75, -1.0)
        assert (record.completion_tokens, record.cached_tokens) == (4, 7)
        assert record.version_lag == 0
    assert episode.provenance["lags"] == [0, 0, 0, 0]
