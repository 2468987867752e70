"""The example tool-using agent (examples/agents) on the real middleware, engines scripted by respx.

Publication, binding, pinning, routing and the transport are the library's own (a
:class:`Deployment` with HTTP push against :class:`ScriptedFleet`); only the engines' HTTP is
scripted, including ``/v1/chat/completions`` and ``/abort_request`` below. Aborts are gated with
events, never timed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentic_lora_agent import REFERENCE_TABLE
from agentic_lora_agent import TASKS
from agentic_lora_agent import AgentConfig
from agentic_lora_agent import AgentObserver
from agentic_lora_agent import AttemptKind
from agentic_lora_agent import AttemptOutcome
from agentic_lora_agent import Calculator
from agentic_lora_agent import EpisodeStatus
from agentic_lora_agent import Lookup
from agentic_lora_agent import PlanStep
from agentic_lora_agent import ScriptedPolicy
from agentic_lora_agent import Task
from agentic_lora_agent import ToolAgent
from agentic_lora_agent import ToolBox
from agentic_lora_agent import ToolCall
from agentic_lora_agent import ToolError
from agentic_lora_agent import default_toolbox
from agentic_lora_agent import episode_json
from agentic_lora_agent import format_tool_call
from agentic_lora_agent import parse_tool_calls
from agentic_lora_agent import percentiles
from agentic_lora_agent import task_for
from hypothesis import given
from hypothesis import strategies as st

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import load_settings
from agentic_lora.errors import ConfigurationError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet

BASE = "tiny-qwen3"


# --- the scripted chat endpoint -------------------------------------------------------------


@dataclass(frozen=True)
class Say:
    """Answer 200 with this content (and optionally engine-parsed tool calls)."""

    content: str = "noise noise noise"
    tool_calls: list[dict[str, Any]] | None = None
    tokens: int = 4


@dataclass(frozen=True)
class Status:
    """Answer with this HTTP status."""

    code: int


@dataclass(frozen=True)
class Fail:
    """Raise this transport error (built for the request)."""

    make: Callable[[httpx.Request], Exception]


@dataclass(frozen=True)
class HoldUntilAborted:
    """Keep the request running until /abort_request names its rid, then end it as aborted."""

    partial: str
    tokens: int


Action = Say | Status | Fail | HoldUntilAborted


@dataclass
class ScriptedChat:
    """``/v1/chat/completions`` and ``/abort_request`` for every engine of a ScriptedFleet."""

    script: deque[Action] = field(default_factory=deque)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    aborts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    held: asyncio.Event = field(default_factory=asyncio.Event)
    _gates: dict[str, asyncio.Event] = field(default_factory=dict)

    def mount(self, fleet: ScriptedFleet) -> None:
        for name, engine in fleet.engines.items():
            fleet.router.post(f"{engine.base_url}/v1/chat/completions").mock(
                side_effect=self._handler(self._chat, name)
            )
            fleet.router.post(f"{engine.base_url}/abort_request").mock(
                side_effect=self._handler(self._abort, name)
            )

    @staticmethod
    def _handler(fn: Any, engine: str) -> Any:
        async def handle(request: httpx.Request) -> httpx.Response:
            result: httpx.Response = await fn(engine, request)
            return result

        return handle

    def then(self, *actions: Action) -> None:
        self.script.extend(actions)

    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.requests]

    async def _chat(self, engine: str, request: httpx.Request) -> httpx.Response:
        action = self.script.popleft() if self.script else Say()
        if isinstance(action, Fail):
            raise action.make(request)
        body: dict[str, Any] = json.loads(request.content)
        self.requests.append((engine, body))
        if isinstance(action, Status):
            return httpx.Response(action.code, json={"object": "error", "code": action.code})
        if isinstance(action, HoldUntilAborted):
            gate = self._gates.setdefault(body["rid"], asyncio.Event())
            self.held.set()
            await gate.wait()
            return _completion(body, action.partial, action.tokens, finish="abort")
        return _completion(body, action.content, action.tokens, tool_calls=action.tool_calls)

    async def _abort(self, engine: str, request: httpx.Request) -> httpx.Response:
        body: dict[str, Any] = json.loads(request.content)
        self.aborts.append((engine, body))
        self._gates.setdefault(body["rid"], asyncio.Event()).set()
        return httpx.Response(200)


def _completion(
    body: Mapping[str, Any],
    content: str,
    tokens: int,
    *,
    finish: str = "length",
    tool_calls: list[dict[str, Any]] | None = None,
) -> httpx.Response:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    logprobs = [{"token": "t", "logprob": -0.25 * (i + 1)} for i in range(tokens)]
    return httpx.Response(
        200,
        json={
            "id": body["rid"],
            "object": "chat.completion",
            "model": body["model"],  # SGLang echoes the requested model
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": logprobs},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": 10 * len(body["messages"]),
                "completion_tokens": tokens,
                "prompt_tokens_details": {"cached_tokens": 7},
            },
        },
    )


@dataclass
class World:
    fleet: ScriptedFleet
    chat: ScriptedChat
    deployment: Deployment
    a_name: str

    def lora(self, version: str) -> str:
        status = self.deployment.registry.peek_version(version)  # type: ignore[attr-defined]
        name: str = status.lora_name
        return name


@asynccontextmanager
async def world(tmp_path: Path, **overrides: Any) -> AsyncIterator[World]:
    """Two scripted engines, a real Deployment, and version A published."""
    with ScriptedFleet() as fleet:
        chat = ScriptedChat()
        chat.mount(fleet)
        settings = load_settings(
            enable_versioned_lora_publication=True,
            engines=[f"{e.name}={e.base_url}" for e in fleet.refs],
            capacity=2,
            http_transport="httpx",  # respx intercepts httpx's own transport
            base_model_name=BASE,
            **overrides,
        )
        async with Deployment.from_settings(
            settings, backend_options={"store_root": str(tmp_path / "adapters")}
        ) as d:
            published = await d.publish("A", tiny_snapshot(1))
            assert published.outcome is PublicationOutcome.PUBLISHED
            assert published.lora_name is not None
            yield World(fleet, chat, d, published.lora_name)


def _plan(*steps: tuple[str, dict[str, str]]) -> tuple[PlanStep, ...]:
    return tuple(PlanStep(tool, args) for tool, args in steps)


OSLO = TASKS["oslo-plus"]  # three tool turns: calculator, lookup, calculator on both
SHORT = AgentConfig(max_tokens=8, temperature=0.0)


# --- episodes through the middleware ---------------------------------------------------------


@pytest.mark.asyncio
async def test_policy_supplies_the_calls_and_every_turn_goes_out_pinned(tmp_path: Path) -> None:
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        clock = itertools.count(1.0).__next__  # one second further on every reading
        agent = ToolAgent(
            s, OSLO, tools=default_toolbox(), config=SHORT, policy=ScriptedPolicy(), clock=clock
        )
        episode = await agent.run()

    assert episode.status is EpisodeStatus.ANSWERED
    assert episode.observations == ("391", "709037", OSLO.expected_answer)
    assert [t.tool_source for t in episode.turns] == ["policy", "policy", "policy", None]
    assert episode.answer == "noise noise noise"
    bodies = w.chat.bodies()
    assert len(bodies) == 4
    pinned = f"{BASE}:{w.a_name}"
    assert {b["model"] for b in bodies} == {pinned}
    # The call and its observation are in the chat the next turn is generated from.
    second = bodies[1]["messages"]
    assert second[2]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": json.dumps({"expression": "17 * 23"}),
    }
    assert second[3] == {"role": "tool", "tool_call_id": "call_0_0", "content": "391"}
    assert bodies[3]["messages"][-1]["content"] == OSLO.expected_answer
    assert [t["function"]["name"] for t in bodies[0]["tools"]] == ["calculator", "lookup"]
    # What the agent recorded is what went out and came back.
    for (engine, body), record in zip(w.chat.requests, episode.attempts, strict=True):
        assert record.rid == body["rid"]
        assert record.engine == engine
        assert record.lora_name == w.a_name
        assert record.served_model == pinned
        assert record.session_id == "s1"
        assert record.outcome is AttemptOutcome.OK
        assert record.latency_s == 1.0
        assert record.prompt_tokens == 10 * len(body["messages"])
        assert (record.completion_tokens, record.cached_tokens) == (4, 7)
        assert record.token_logprobs == (-0.25, -0.5, -0.75, -1.0)
        assert record.logprob == -2.5
        assert record.version_lag == 0
    assert episode.lora_names == {w.a_name}
    # The Session's provenance travels with the episode, and into its JSON record.
    digest = w.deployment.registry.peek_version("A").digest  # type: ignore[attr-defined]
    assert episode.provenance == {
        "session_id": "s1",
        "version_id": "A",
        "digest": digest,
        "lora_name": w.a_name,
        "default_revision_at_bind": 1,
        "rolled_back_from": None,
        "lags": [0, 0, 0, 0],
        "turns": 4,
        "too_stale_lag": None,
    }
    record_json = json.loads(json.dumps(episode_json(episode)))
    assert record_json["provenance"] == episode.provenance
    assert [a["version_lag"] for a in record_json["attempts"]] == [0, 0, 0, 0]


@pytest.mark.parametrize("where", ["content", "tool_calls"])
@pytest.mark.asyncio
async def test_a_parsable_model_call_wins_over_the_policy(tmp_path: Path, where: str) -> None:
    task = Task(
        "double",
        "double it",
        plan=_plan(
            ("calculator", {"expression": "1 + 1"}),
            ("calculator", {"expression": "{0} * 2"}),
        ),
    )
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        if where == "content":
            first = Say(content="thinking " + format_tool_call("calculator", {"expression": "6*7"}))
        else:
            first = Say(
                content="thinking",
                tool_calls=[
                    {
                        "id": "engine-call-1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
                    }
                ],
            )
        w.chat.then(first)
        episode = await ToolAgent(
            s, task, tools=default_toolbox(), config=SHORT, policy=ScriptedPolicy()
        ).run()

    assert [t.tool_source for t in episode.turns] == ["model", "policy", None]
    # The policy's second step computed with what the model's own call returned.
    assert episode.observations == ("42", "84")
    assistant = w.chat.bodies()[1]["messages"][2]
    assert assistant["content"] == "thinking"
    expected_id = "call_0_0" if where == "content" else "engine-call-1"
    assert assistant["tool_calls"][0]["id"] == expected_id


@pytest.mark.asyncio
async def test_an_unreadable_call_is_sampled_again_on_the_same_version(tmp_path: Path) -> None:
    task = Task("one", "compute", plan=_plan(("calculator", {"expression": "1 + 1"})))
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        w.chat.then(
            Say(content='<tool_call>{"name": "calculator", "arguments": {</tool_call>'),
            Say(content=format_tool_call("calculator", {"expression": "2 ** 5"})),
        )
        episode = await ToolAgent(
            s, task, tools=default_toolbox(), config=SHORT, policy=ScriptedPolicy()
        ).run()

    first = episode.turns[0]
    assert [a.kind for a in first.attempts] == [AttemptKind.FIRST, AttemptKind.RESAMPLE]
    assert first.tool_source == "model"
    assert episode.observations[0] == "32"
    assert {b["model"] for b in w.chat.bodies()} == {f"{BASE}:{w.a_name}"}


@pytest.mark.asyncio
async def test_a_prompt_the_engine_refuses_is_compacted_and_retried(tmp_path: Path) -> None:
    manual = "word " * 2000
    task = Task("manual", "read it", plan=_plan(("lookup", {"key": "manual"})))
    tools = default_toolbox({"manual": manual})
    config = AgentConfig(max_tokens=8, compact_observation_chars=100)
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        # Turn 0 fine; turn 1's prompt (with the manual in it) is refused with HTTP 400.
        w.chat.then(Say(), Status(400))
        episode = await ToolAgent(
            s, task, tools=tools, config=config, policy=ScriptedPolicy()
        ).run()

    assert episode.status is EpisodeStatus.ANSWERED
    refused, retried = episode.turns[1].attempts
    assert (refused.outcome, refused.http_status, refused.error_code) == (
        AttemptOutcome.REFUSED,
        400,
        "REQUEST_REFUSED",
    )
    assert (retried.kind, retried.outcome) == (AttemptKind.RETRY, AttemptOutcome.OK)
    assert refused.lora_name == retried.lora_name == w.a_name
    before, after = (b["messages"][-1]["content"] for b in w.chat.bodies()[1:])
    assert before == manual
    assert after.startswith(manual[:100])
    assert after.endswith(f"[... {len(manual) - 100} chars cut]")
    assert len(w.chat.requests) == 3


@pytest.mark.asyncio
async def test_a_refusal_with_nothing_to_compact_ends_the_episode(tmp_path: Path) -> None:
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        w.chat.then(Status(400))
        episode = await ToolAgent(s, OSLO, tools=default_toolbox(), config=SHORT).run()

    assert (episode.status, episode.error_code) == (EpisodeStatus.REFUSED, "REQUEST_REFUSED")
    assert len(w.chat.requests) == 1


@pytest.mark.asyncio
async def test_an_unreachable_engine_is_retried_unchanged_within_the_budget(
    tmp_path: Path,
) -> None:
    config = AgentConfig(max_tokens=8, max_retries=2)
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        refuse = Fail(lambda r: httpx.ConnectError("connection refused", request=r))
        w.chat.then(refuse, refuse, refuse)
        episode = await ToolAgent(s, OSLO, tools=default_toolbox(), config=config).run()

    attempts = episode.turns[0].attempts
    assert [a.kind for a in attempts] == [AttemptKind.FIRST, AttemptKind.RETRY, AttemptKind.RETRY]
    assert all(a.outcome is AttemptOutcome.REFUSED and a.http_status is None for a in attempts)
    assert episode.status is EpisodeStatus.REFUSED
    assert w.chat.script == deque()  # exactly three sends: the first and two retries


@pytest.mark.parametrize(
    "failure",
    [Status(500), Fail(lambda r: httpx.ReadError("reply lost", request=r))],
    ids=["http-500", "lost-reply"],
)
@pytest.mark.asyncio
async def test_an_indeterminate_generation_is_never_resent(tmp_path: Path, failure: Action) -> None:
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        w.chat.then(failure, Say())
        episode = await ToolAgent(
            s, OSLO, tools=default_toolbox(), config=SHORT, policy=ScriptedPolicy()
        ).run()

    assert episode.status is EpisodeStatus.INDETERMINATE
    assert episode.error_code == "REQUEST_INDETERMINATE"
    assert [a.outcome for a in episode.attempts] == [AttemptOutcome.INDETERMINATE]
    assert len(w.chat.script) == 1  # the scripted success was never asked for


class _Turns(AgentObserver):
    def __init__(self) -> None:
        self.dispatched: list[tuple[int, AttemptKind]] = []
        self.ended: list[AttemptOutcome] = []

    def on_dispatch(self, agent: ToolAgent, turn: int, kind: AttemptKind, rid: str) -> None:
        self.dispatched.append((turn, kind))

    def on_attempt(self, agent: ToolAgent, record: Any) -> None:
        self.ended.append(record.outcome)


@pytest.mark.asyncio
async def test_interrupt_aborts_and_the_resume_keeps_a_after_b_is_published(
    tmp_path: Path,
) -> None:
    config = AgentConfig(max_tokens=40, temperature=0.0)
    async with world(tmp_path) as w:
        d = w.deployment
        observer = _Turns()
        async with d.session("old") as s_old:
            w.chat.then(HoldUntilAborted(partial="partial answer", tokens=15))
            agent = ToolAgent(
                s_old,
                OSLO,
                tools=default_toolbox(),
                config=config,
                policy=ScriptedPolicy(),
                observer=observer,
            )
            running = asyncio.create_task(agent.run())
            await w.chat.held.wait()
            held_rid = agent.in_flight_rid
            assert held_rid is not None
            # B becomes the default while the old Session's first generation runs.
            assert (await d.publish("B", tiny_snapshot(2))).outcome is PublicationOutcome.PUBLISHED
            assert await agent.interrupt() is True
            episode = await running
        async with d.session("new") as s_new:
            fresh = await ToolAgent(
                s_new, OSLO, tools=default_toolbox(), config=config, policy=ScriptedPolicy()
            ).run()
        b_name = w.lora("B")

    held_engine = w.chat.requests[0][0]
    assert w.chat.aborts == [(held_engine, {"rid": held_rid})]
    aborted, resumed = episode.turns[0].attempts
    assert (aborted.outcome, aborted.kind) == (AttemptOutcome.ABORTED, AttemptKind.FIRST)
    assert (resumed.outcome, resumed.kind) == (AttemptOutcome.OK, AttemptKind.RESUME)
    resume_body = w.chat.bodies()[1]
    assert resume_body["continue_final_message"] is True
    assert resume_body["add_generation_prompt"] is False
    assert resume_body["messages"][-1] == {"role": "assistant", "content": "partial answer"}
    assert resume_body["max_tokens"] == 40 - 15
    assert episode.turns[0].text == "partial answer" + "noise noise noise"
    assert episode.status is EpisodeStatus.ANSWERED
    # Every request of the old episode, before and after B's commit, carried A; the new one B.
    old_bodies = [b for b in w.chat.bodies() if b["rid"].startswith("old-")]
    new_bodies = [b for b in w.chat.bodies() if b["rid"].startswith("new-")]
    assert len(old_bodies) == 5
    assert {b["model"] for b in old_bodies} == {f"{BASE}:{w.a_name}"}
    assert {b["model"] for b in new_bodies} == {f"{BASE}:{b_name}"}
    assert episode.lora_names == {w.a_name}
    assert fresh.lora_names == {b_name}
    # The resume started after B's commit: A was one publication behind from then on.
    assert (aborted.version_lag, resumed.version_lag) == (0, 1)
    assert episode.provenance is not None
    assert episode.provenance["version_id"] == "A"
    assert episode.provenance["lags"] == [0, 1, 1, 1, 1]
    assert fresh.provenance is not None
    assert (fresh.provenance["version_id"], fresh.provenance["default_revision_at_bind"]) == (
        "B",
        2,
    )
    assert set(fresh.provenance["lags"]) == {0}
    assert observer.dispatched[:2] == [(0, AttemptKind.FIRST), (0, AttemptKind.RESUME)]
    assert observer.ended[:2] == [AttemptOutcome.ABORTED, AttemptOutcome.OK]


@pytest.mark.asyncio
async def test_aborts_beyond_the_resume_budget_end_the_episode(tmp_path: Path) -> None:
    config = AgentConfig(max_tokens=40, max_resumes=0)
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        w.chat.then(HoldUntilAborted(partial="p", tokens=3))
        agent = ToolAgent(s, OSLO, tools=default_toolbox(), config=config)
        running = asyncio.create_task(agent.run())
        await w.chat.held.wait()
        assert await agent.interrupt() is True
        episode = await running

    assert episode.status is EpisodeStatus.INTERRUPTED
    assert len(w.chat.requests) == 1


@pytest.mark.asyncio
async def test_an_abort_after_the_last_token_completes_the_turn(tmp_path: Path) -> None:
    task = Task("one", "compute", plan=_plan(("calculator", {"expression": "3 * 3"})))
    config = AgentConfig(max_tokens=5)
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        w.chat.then(HoldUntilAborted(partial="done", tokens=5))
        agent = ToolAgent(s, task, tools=default_toolbox(), config=config, policy=ScriptedPolicy())
        running = asyncio.create_task(agent.run())
        await w.chat.held.wait()
        assert await agent.interrupt() is True
        episode = await running

    assert [a.outcome for a in episode.turns[0].attempts] == [AttemptOutcome.ABORTED]
    assert episode.observations == ("9",)
    assert episode.status is EpisodeStatus.ANSWERED


@pytest.mark.asyncio
async def test_interrupt_with_nothing_in_flight_sends_nothing(tmp_path: Path) -> None:
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        agent = ToolAgent(s, OSLO, tools=default_toolbox(), config=SHORT)
        assert await agent.interrupt() is False
    assert w.chat.aborts == []


@pytest.mark.asyncio
async def test_a_closed_session_fails_the_episode_without_a_request(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        s = w.deployment.versioning.open_session("s1")
        await s.close()
        episode = await ToolAgent(s, OSLO, tools=default_toolbox(), config=SHORT).run()
    assert (episode.status, episode.error_code) == (EpisodeStatus.FAILED, "SESSION_CLOSED")
    assert w.chat.requests == []


@pytest.mark.asyncio
async def test_a_too_stale_session_fails_the_episode_and_its_provenance_says_why(
    tmp_path: Path,
) -> None:
    class _PublishAfterFirstTurn(AgentObserver):
        def __init__(self, deployment: Deployment) -> None:
            self.deployment = deployment

        async def before_turn(self, agent: ToolAgent, turn: int) -> None:
            if turn == 1:
                await self.deployment.publish("B", tiny_snapshot(2))

    async with world(tmp_path, max_version_lag=0) as w, w.deployment.session("s1") as s:
        episode = await ToolAgent(
            s,
            OSLO,
            tools=default_toolbox(),
            config=SHORT,
            policy=ScriptedPolicy(),
            observer=_PublishAfterFirstTurn(w.deployment),
        ).run()
    assert (episode.status, episode.error_code) == (EpisodeStatus.FAILED, "VERSION_TOO_STALE")
    assert len(w.chat.requests) == 1  # the refused turn sent nothing
    assert episode.provenance is not None
    assert (episode.provenance["lags"], episode.provenance["too_stale_lag"]) == ([0], 1)


@pytest.mark.asyncio
async def test_the_turn_budget_ends_an_episode_that_keeps_calling_tools(tmp_path: Path) -> None:
    endless = Task("endless", "loop", plan=_plan(*[("calculator", {"expression": "1"})] * 5))
    async with world(tmp_path) as w, w.deployment.session("s1") as s:
        config = AgentConfig(max_turns=3, max_tokens=4)
        episode = await ToolAgent(
            s, endless, tools=default_toolbox(), config=config, policy=ScriptedPolicy()
        ).run()
    assert episode.status is EpisodeStatus.MAX_TURNS
    assert len(episode.turns) == 3
    assert len(w.chat.requests) == 3


def test_agent_config_refuses_impossible_budgets() -> None:
    for bad in ({"max_turns": 0}, {"max_tokens": 0}, {"max_retries": -1}, {"temperature": -1.0}):
        with pytest.raises(ConfigurationError) as err:
            AgentConfig(**bad)
        assert err.value.details["check"] == "agent_config"


# --- parsing ----------------------------------------------------------------------------------

_names = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
_prose = st.text(alphabet="abc xyz.,!\n", max_size=20)


@given(
    name=_names, arguments=st.dictionaries(st.text(max_size=8), _json, max_size=4), before=_prose
)
def test_a_formatted_call_parses_back_to_itself(
    name: str, arguments: dict[str, Any], before: str
) -> None:
    parsed = parse_tool_calls({"content": before + format_tool_call(name, arguments)}, turn=3)
    assert parsed.problems == ()
    assert parsed.calls == (ToolCall(name, arguments, call_id="call_3_0"),)
    assert parsed.text == before.strip()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "without a name"),
        ('<tool_call>{"name": "calculator", "arguments": "[1]"}</tool_call>', "not a JSON object"),
        ('so <tool_call>{"name": "calculator", "argu', "opened but never closed"),
    ],
)
def test_unreadable_calls_are_reported_not_guessed(content: str, problem: str) -> None:
    parsed = parse_tool_calls({"content": content})
    assert parsed.calls == ()
    assert parsed.malformed
    assert problem in parsed.problems[0]


def test_arguments_may_be_a_json_string_and_several_calls_keep_their_order() -> None:
    content = (
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}</tool_call> and '
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    )
    parsed = parse_tool_calls({"content": content}, turn=1)
    assert [(c.name, dict(c.arguments), c.call_id) for c in parsed.calls] == [
        ("lookup", {"key": "x"}, "call_1_0"),
        ("calculator", {"expression": "1"}, "call_1_1"),
    ]
    assert parsed.text == "and"


def test_engine_parsed_calls_win_and_bad_entries_are_reported() -> None:
    message = {
        "content": "text",
        "tool_calls": [
            {"id": "c9", "function": {"name": "lookup", "arguments": '{"key": "k"}'}},
            {"id": "c10", "function": {"name": "lookup", "arguments": "{oops"}},
            {"id": "c11"},
        ],
    }
    parsed = parse_tool_calls(message)
    assert [(c.name, c.call_id) for c in parsed.calls] == [("lookup", "c9")]
    assert len(parsed.problems) == 2
    assert parsed.text == "text"


def test_plain_text_has_no_calls_and_no_problems() -> None:
    parsed = parse_tool_calls({"content": "  the answer is 4  "})
    assert (parsed.calls, parsed.problems, parsed.text) == ((), (), "the answer is 4")
    assert parse_tool_calls({"content": None}).text == ""


# --- tools ------------------------------------------------------------------------------------


@st.composite
def _int_expressions(draw: st.DrawFn, depth: int = 3) -> tuple[str, int]:
    if depth == 0 or draw(st.booleans()):
        value = draw(st.integers(min_value=-1000, max_value=1000))
        return (f"({value})" if value < 0 else str(value)), value
    op = draw(st.sampled_from(["+", "-", "*"]))
    left_text, left = draw(_int_expressions(depth - 1))
    right_text, right = draw(_int_expressions(depth - 1))
    value = {"+": left + right, "-": left - right, "*": left * right}[op]
    return f"({left_text} {op} {right_text})", value


@given(_int_expressions())
def test_the_calculator_agrees_with_integer_arithmetic(case: tuple[str, int]) -> None:
    text, value = case
    assert Calculator().evaluate(text) == value
    assert Calculator()({"expression": text}) == str(value)


def test_the_calculator_formats_and_divides() -> None:
    calc = Calculator()
    assert calc({"expression": "100 * 9 / 5 + 32"}) == "212"
    assert calc({"expression": "1 / 3"}) == "0.333333333333"
    assert calc({"expression": "8849 // 366"}) == "24"
    assert calc({"expression": "-2 ** 3 % 5"}) == "2"


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("a + 1", "unsupported syntax"),
        ("(1).real", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("'a' * 3", "unsupported syntax"),
        ("2 ** 1000", "exponent"),
        ("10.0 ** 60 * 10.0 ** 60", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("9" * 201, "longer than"),
        ("   ", "non-empty"),
        (5, "non-empty string"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression: Any, why: str) -> None:
    with pytest.raises(ToolError, match=why):
        Calculator().evaluate(expression)


def test_lookup_ignores_case_and_spacing_and_names_known_keys_on_a_miss() -> None:
    table = Lookup({"Capital of Norway": "Oslo", "b": "2"})
    assert table.get("  capital   OF norway ") == "Oslo"
    with pytest.raises(ToolError, match=r"no entry for 'x'.*b, capital of norway"):
        table.get("x")
    with pytest.raises(ValueError, match="normalise"):
        Lookup({"A  b": "1", "a b": "2"})


def test_the_toolbox_turns_every_failure_into_an_error_observation() -> None:
    box = default_toolbox()
    ok = box.run(ToolCall("lookup", {"key": "capital of japan"}))
    assert (ok.observation, ok.ok) == ("Tokyo", True)
    unknown = box.run(ToolCall("weather", {}))
    assert not unknown.ok
    assert unknown.observation.startswith("error: unknown tool 'weather'")
    bad = box.run(ToolCall("calculator", {"expression": 7}))
    assert (bad.ok, bad.observation) == (False, "error: expression must be a non-empty string")
    missing = box.run(ToolCall("lookup", {}))
    assert missing.observation == "error: key must be a non-empty string"
    with pytest.raises(ValueError, match="duplicate"):
        ToolBox([Calculator().tool(), Calculator().tool()])


def test_each_tool_declares_its_one_required_string_argument() -> None:
    schemas = {
        s["function"]["name"]: s["function"]["parameters"] for s in default_toolbox().schemas()
    }
    assert schemas == {
        "calculator": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 17 * 23"}},
            "required": ["expression"],
        },
        "lookup": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "e.g. population of oslo"}},
            "required": ["key"],
        },
    }


# --- policy and stats -------------------------------------------------------------------------


def test_the_scripted_policy_is_keyed_on_the_turn_and_fills_observations() -> None:
    policy = ScriptedPolicy()
    first = policy.next_call(OSLO, 0, [])
    assert first == ToolCall("calculator", {"expression": "17 * 23"}, "call_0_0", "policy")
    third = policy.next_call(OSLO, 2, ["391", "709037"])
    assert third is not None
    assert third.arguments == {"expression": "391 + 709037"}
    # A placeholder without an observation is sent as written; the tool reports it.
    early = policy.next_call(OSLO, 2, ["391"])
    assert early is not None
    assert early.arguments == {"expression": "{0} + {1}"}
    assert policy.next_call(OSLO, 3, ["391", "709037", "709428"]) is None


@pytest.mark.parametrize("task_id", list(TASKS))
def test_a_built_in_plan_ends_on_its_expected_answer(task_id: str) -> None:
    task, policy, box = TASKS[task_id], ScriptedPolicy(), default_toolbox()
    observations: list[str] = []
    while (call := policy.next_call(task, len(observations), observations)) is not None:
        result = box.run(call)
        assert result.ok, result.observation
        observations.append(result.observation)
    assert len(observations) == len(task.plan)
    assert observations[-1] == task.expected_answer


def test_the_task_catalogue_loads_every_task_with_a_plan_over_the_reference_table() -> None:
    # The order is part of the catalogue: task_for hands the tasks out in it.
    assert list(TASKS) == ["oslo-plus", "fahrenheit", "light-minute", "two-cities", "everest-days"]
    for built_in in TASKS.values():
        assert built_in.expected_answer is not None
        assert built_in.plan
        assert all(isinstance(step, PlanStep) for step in built_in.plan)
    keys = {s.arguments["key"] for t in TASKS.values() for s in t.plan if s.tool == "lookup"}
    assert keys <= set(REFERENCE_TABLE)


def test_agents_take_the_built_in_tasks_in_turn_each_from_its_own_offset() -> None:
    ids = list(TASKS)
    assert [task_for(0, episode).task_id for episode in range(len(ids))] == ids
    assert [task_for(agent, 0).task_id for agent in range(len(ids))] == ids
    assert task_for(2, len(ids) + 1) is task_for(3, 0)


def test_percentiles() -> None:
    assert percentiles([]) is None
    single = percentiles([0.5])
    assert single is not None
    assert (single.p50, single.p99, single.count) == (0.5, 0.5, 1)
    spread = percentiles([float(i) for i in range(1, 101)])
    assert spread is not None
    assert (spread.p50, spread.maximum, spread.count) == (50.5, 100.0, 100)
    assert spread.p95 == pytest.approx(95.05)
    assert spread.p99 == pytest.approx(99.01)
