"""A multi-turn tool-using agent over one agentic-lora Session.

Each turn is one OpenAI chat completion sent through :meth:`Session.chat_completions`: the Session
binds a version at the first turn and pins that exact adapter on every later request, so tool
turns, retries, resumes and resamples of one episode all run on one policy. The loop::

    system + user prompt
    repeat: generate -> parse tool calls (model output; else the fallback policy, if any)
            -> no call: the text is the final answer
            -> run the tools, append the assistant call and one ``tool`` message per observation

What the agent does when a generation does not simply succeed is decided here, above the Session,
because nothing below it ever resends (see :mod:`agentic_lora.engines.transport`):

* **refused** (:class:`~agentic_lora.errors.RequestRefusedError`, the engine provably did not
  accept it): if the engine answered 4xx the request itself was rejected, typically a prompt that
  no longer fits the context after a large tool observation; the latest oversized observation is
  shortened and the turn retried. A refusal before the engine was reached is retried as is.
  Both are bounded by ``max_retries``.
* **indeterminate** (it may have run): never resent; the episode ends ``INDETERMINATE``.
* **aborted** (``finish_reason == "abort"``, e.g. after :meth:`ToolAgent.interrupt`): resumed by
  continuing the partial assistant message (``continue_final_message``) with the rest of the token
  budget, bounded by ``max_resumes``.
* **unreadable tool call**: sampled again, bounded by ``max_resamples``.
* any other middleware refusal (the Session is closing, its version is being reclaimed, or its
  version fell more than ``max_version_lag`` publications behind: ``VERSION_TOO_STALE``): the
  episode ends ``FAILED`` with the error code; whether to train on it is the trainer's choice.

Every :class:`~agentic_lora_agent.records.Episode` carries the Session's
:meth:`~agentic_lora.session.Session.provenance` (which version produced it and each turn's lag).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Final

from pydantic import ValidationError

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.foundation.requests import ChatCompletionResponse
from agentic_lora.session import Session
from agentic_lora_agent.parsing import ParsedOutput
from agentic_lora_agent.parsing import parse_tool_calls
from agentic_lora_agent.policy import FallbackPolicy
from agentic_lora_agent.policy import Task
from agentic_lora_agent.records import AttemptKind
from agentic_lora_agent.records import AttemptOutcome
from agentic_lora_agent.records import AttemptRecord
from agentic_lora_agent.records import Episode
from agentic_lora_agent.records import EpisodeStatus
from agentic_lora_agent.records import TurnRecord
from agentic_lora_agent.streamed import stream_turn
from agentic_lora_agent.tools import ToolBox

__all__ = ["DEFAULT_SYSTEM_PROMPT", "AgentConfig", "AgentObserver", "ToolAgent"]

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful assistant. Use the tools to compute and look up facts; "
    "when you know the answer, reply with it and call no tool."
)


@dataclass(frozen=True)
class AgentConfig:
    """Budgets and sampling for one episode.

    ``extra_body`` is merged into every request (engine-specific options such as SGLang's
    ``ignore_eos``, or ``skip_special_tokens: false`` for a model whose tool tags are special
    tokens); the agent's own keys win over it.
    """

    max_turns: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    max_retries: int = 2
    max_resumes: int = 2
    max_resamples: int = 1
    compact_observation_chars: int = 1000
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    #: Ask for every turn as a stream (:mod:`agentic_lora_agent.streamed`) and assemble it.
    stream: bool = False

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "compact_observation_chars"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be at least 1", check="agent_config")
        for name in ("max_retries", "max_resumes", "max_resamples"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"{name} must not be negative", check="agent_config")
        if self.temperature < 0:
            raise ConfigurationError("temperature must not be negative", check="agent_config")


class AgentObserver:
    """Hooks for whoever runs agents (a rollout controller, the demo). The defaults do nothing."""

    async def before_turn(self, agent: ToolAgent, turn: int) -> None:
        """Awaited before each turn's first generation (a scheduling point)."""

    def on_dispatch(self, agent: ToolAgent, turn: int, kind: AttemptKind, rid: str) -> None:
        """Called right before a generation is handed to the Session."""

    def on_attempt(self, agent: ToolAgent, record: AttemptRecord) -> None:
        """Called when a generation ended, however it ended."""


@dataclass(frozen=True, slots=True)
class _Reply:
    message: Mapping[str, Any]
    content: str
    finish_reason: str | None
    token_logprobs: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    model: str | None


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _read_reply(body: Any) -> _Reply:
    """The fields the agent uses from a chat completion body; ValueError if it has no choice."""
    try:
        parsed = ChatCompletionResponse.model_validate(body)
    except ValidationError as exc:
        raise ValueError(f"not a chat completion: {exc.error_count()} problems") from None
    if not parsed.choices:
        raise ValueError("a chat completion without choices")
    choice = parsed.choices[0]
    message = choice.get("message")
    if not isinstance(message, Mapping):
        raise ValueError("a chat completion choice without a message")
    content = message.get("content")
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    token_logprobs = tuple(
        float(e["logprob"])
        for e in (entries if isinstance(entries, list) else [])
        if isinstance(e, Mapping) and isinstance(e.get("logprob"), int | float)
    )
    usage = parsed.usage or {}
    details = usage.get("prompt_tokens_details")
    finish = choice.get("finish_reason")
    return _Reply(
        message=message,
        content=content if isinstance(content, str) else "",
        finish_reason=finish if isinstance(finish, str) else None,
        token_logprobs=token_logprobs,
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
        cached_tokens=_int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0,
        model=parsed.model,
    )


class _EpisodeEnd(Exception):
    """Raised inside a turn when the episode cannot go on."""

    def __init__(self, status: EpisodeStatus, error_code: str | None = None) -> None:
        super().__init__(status.value)
        self.status = status
        self.error_code = error_code


@dataclass(frozen=True, slots=True)
class _Generated:
    parsed: ParsedOutput
    text: str


class ToolAgent:
    """Runs one :class:`Task` as a multi-turn tool-using episode on one Session.

    ``policy`` is consulted only for a turn whose output has no parsable tool call; leave it
    None for a real model. ``clock`` only feeds the recorded timestamps and latencies.
    """

    def __init__(
        self,
        session: Session,
        task: Task,
        *,
        tools: ToolBox,
        config: AgentConfig | None = None,
        policy: FallbackPolicy | None = None,
        observer: AgentObserver | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        # Read-only (Final): an agent runs one task on one Session for its whole life.
        self.session: Final = session
        """The Session every generation of this agent goes through."""
        self.task: Final = task
        """The task this agent runs."""
        self._tools = tools
        self._config = config or AgentConfig()
        self._policy = policy
        self._observer = observer or AgentObserver()
        self._clock = clock
        self._in_flight: str | None = None

    @property
    def in_flight_rid(self) -> str | None:
        """The request id of the generation in flight, if any."""
        return self._in_flight

    async def interrupt(self) -> bool:
        """Abort the generation in flight through the Session (``/abort_request`` on its engine).

        The agent then resumes the turn from its partial output, on the same bound version.
        Returns False when nothing is in flight or it is not yet routed to an engine. An abort
        that reaches the engine before the request does is dropped by SGLang, so a controller
        that must stop the request calls this again until the turn's attempt has ended.
        """
        rid = self._in_flight
        if rid is None:
            return False
        return await self.session.abort(rid)

    # --- the episode ---------------------------------------------------------------------------

    async def run(self) -> Episode:
        """Run the episode to its end; the Session stays open (the caller closes it)."""
        cfg = self._config
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": cfg.system_prompt},
            {"role": "user", "content": self.task.prompt},
        ]
        observations: list[str] = []
        turns: list[TurnRecord] = []
        status, answer, error_code = EpisodeStatus.MAX_TURNS, None, None
        for turn in range(cfg.max_turns):
            await self._observer.before_turn(self, turn)
            attempts: list[AttemptRecord] = []
            try:
                generated = await self._generate_turn(turn, messages, attempts)
            except _EpisodeEnd as end:
                turns.append(TurnRecord(turn, tuple(attempts), ""))
                status, error_code = end.status, end.error_code
                break
            calls = generated.parsed.calls
            if not calls and self._policy is not None:
                chosen = self._policy.next_call(self.task, turn, observations)
                calls = (chosen,) if chosen is not None else ()
            if not calls:
                turns.append(TurnRecord(turn, tuple(attempts), generated.text))
                status, answer = EpisodeStatus.ANSWERED, generated.parsed.text
                break
            results = tuple(self._tools.run(call) for call in calls)
            messages.append(
                {
                    "role": "assistant",
                    "content": generated.parsed.text,
                    "tool_calls": [call.as_message_part() for call in calls],
                }
            )
            for result in results:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": result.call.call_id,
                        "content": result.observation,
                    }
                )
                observations.append(result.observation)
            turns.append(TurnRecord(turn, tuple(attempts), generated.text, calls, results))
        binding = self.session.binding
        return Episode(
            session_id=self.session.session_id,
            task_id=self.task.task_id,
            status=status,
            turns=tuple(turns),
            lora_name=binding.lora_name if binding is not None else None,
            answer=answer,
            error_code=error_code,
            provenance=self.session.provenance(),
        )

    async def _generate_turn(
        self, turn: int, messages: list[dict[str, Any]], attempts: list[AttemptRecord]
    ) -> _Generated:
        """One turn's generation, with its retries, resumes and resamples (see module doc)."""
        cfg = self._config
        budget = self.task.max_tokens(turn, cfg.max_tokens)
        retries = resumes = resamples = 0
        partial, generated = "", 0
        kind = AttemptKind.FIRST
        while True:
            body = self._request(messages, max_tokens=budget - generated, partial=partial or None)
            record, reply = await self._attempt(turn, len(attempts) + 1, kind, body)
            attempts.append(record)
            if record.outcome is AttemptOutcome.OK:
                assert reply is not None
                text = partial + reply.content
                message = {**reply.message, "content": text}
                parsed = parse_tool_calls(message, turn=turn)
                if parsed.malformed and resamples < cfg.max_resamples:
                    resamples += 1
                    partial, generated, kind = "", 0, AttemptKind.RESAMPLE
                    continue
                return _Generated(parsed, text)
            if record.outcome is AttemptOutcome.ABORTED:
                assert reply is not None
                partial += reply.content
                generated += reply.completion_tokens
                if generated >= budget:
                    # The abort came after the last token: the turn is complete as it stands.
                    return _Generated(parse_tool_calls({"content": partial}, turn=turn), partial)
                if resumes >= cfg.max_resumes:
                    raise _EpisodeEnd(EpisodeStatus.INTERRUPTED)
                resumes += 1
                kind = AttemptKind.RESUME
                continue
            if record.outcome is AttemptOutcome.REFUSED:
                if retries >= cfg.max_retries:
                    raise _EpisodeEnd(EpisodeStatus.REFUSED, record.error_code)
                # An engine that answered 4xx rejected this very request: sending it unchanged
                # would be refused again. Nothing reached an engine otherwise: resend as is.
                if record.http_status is not None and not self._compact(messages):
                    raise _EpisodeEnd(EpisodeStatus.REFUSED, record.error_code)
                retries += 1
                kind = AttemptKind.RETRY
                continue
            status = (
                EpisodeStatus.INDETERMINATE
                if record.outcome is AttemptOutcome.INDETERMINATE
                else EpisodeStatus.FAILED
            )
            raise _EpisodeEnd(status, record.error_code)

    def _request(
        self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int, partial: str | None
    ) -> dict[str, Any]:
        cfg = self._config
        body: dict[str, Any] = dict(cfg.extra_body)
        chat = [dict(m) for m in messages]
        if partial is not None:
            # Resume: the engine continues the partial answer instead of starting a new one.
            chat.append({"role": "assistant", "content": partial})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        body.update(
            messages=chat,
            tools=self._tools.schemas(),
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            logprobs=True,
            rid=f"{self.session.session_id}-{uuid.uuid4().hex[:12]}",
        )
        return body

    def _compact(self, messages: list[dict[str, Any]]) -> bool:
        """Shorten the latest tool observation longer than the limit; False if there is none."""
        limit = self._config.compact_observation_chars
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            content = message.get("content")
            if message.get("role") == "tool" and isinstance(content, str) and len(content) > limit:
                cut = len(content) - limit
                messages[index] = {**message, "content": f"{content[:limit]} [... {cut} chars cut]"}
                return True
        return False

    async def _attempt(
        self, turn: int, number: int, kind: AttemptKind, body: dict[str, Any]
    ) -> tuple[AttemptRecord, _Reply | None]:
        rid: str = body["rid"]
        session = self.session
        self._observer.on_dispatch(self, turn, kind, rid)
        self._in_flight = rid
        started = self._clock()
        reply: _Reply | None = None
        lag: int | None = None
        outcome = AttemptOutcome.OK
        engine: str | None = None
        code: str | None = None
        error: str | None = None
        status: int | None = None
        try:
            answer = (
                await stream_turn(session, body)
                if self._config.stream
                else await session.chat_completions(body)
            )
            engine = answer.engine
            lag = answer.provenance.lag if answer.provenance is not None else None
            reply = _read_reply(answer.body)
        except (RequestRefusedError, RequestIndeterminateError) as exc:
            refused = isinstance(exc, RequestRefusedError)
            outcome = AttemptOutcome.REFUSED if refused else AttemptOutcome.INDETERMINATE
            code, error = exc.code, exc.message
            engine = exc.details.get("engine")
            given = exc.details.get("status")
            status = given if isinstance(given, int) else None
        except AgenticLoRAError as exc:
            outcome, code, error = AttemptOutcome.FAILED, exc.code, exc.message
        except ValueError as exc:
            outcome, code, error = AttemptOutcome.FAILED, "BAD_REPLY", str(exc)
        finally:
            self._in_flight = None
        latency = self._clock() - started
        if reply is not None and reply.finish_reason == "abort":
            outcome = AttemptOutcome.ABORTED
        binding = session.binding
        record = AttemptRecord(
            session_id=session.session_id,
            task_id=self.task.task_id,
            turn=turn,
            attempt=number,
            kind=kind,
            rid=rid,
            outcome=outcome,
            lora_name=binding.lora_name if binding is not None else None,
            served_model=reply.model if reply is not None else None,
            engine=engine,
            started_at=started,
            latency_s=latency,
            prompt_tokens=reply.prompt_tokens if reply else 0,
            completion_tokens=reply.completion_tokens if reply else 0,
            cached_tokens=reply.cached_tokens if reply else 0,
            token_logprobs=reply.token_logprobs if reply else (),
            finish_reason=reply.finish_reason if reply else None,
            text=reply.content if reply else "",
            error_code=code,
            error=error,
            http_status=status,
            version_lag=lag,
        )
        logger.info(
            "generation %s",
            outcome.value,
            extra={
                "session": session.key,
                "version": record.lora_name,
                "engine": engine,
                "attempt": number,
                "turn": turn,
                "kind": kind.value,
                "rid": rid,
            },
        )
        self._observer.on_attempt(self, record)
        return record, reply
