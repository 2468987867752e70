"""What an episode leaves behind: one record per engine request, grouped by turn.

Every HTTP attempt of a generation, successful or not, is an :class:`AttemptRecord`: the Session
and the version it was bound to, the engine that served it, tokens, latency and the logprob of
every sampled token. A :class:`TurnRecord` groups the attempts of one turn (a first attempt, then
any retry, resume or resample) with the tool calls that followed it.

An :class:`Episode` also carries its Session's provenance (``Session.provenance()``: version id,
full digest, adapter name, default revision at bind and the lag of every turn), the record a
trainer stores with the trajectory for importance weighting or for dropping by lag.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentic_lora_agent.tools import ToolCall
from agentic_lora_agent.tools import ToolResult

__all__ = [
    "AttemptKind",
    "AttemptOutcome",
    "AttemptRecord",
    "Episode",
    "EpisodeStatus",
    "TurnRecord",
]


class AttemptKind(enum.StrEnum):
    """Why a generation was sent."""

    FIRST = "first"  # the turn's first generation
    RETRY = "retry"  # again after the engine refused the previous one (it never ran)
    RESUME = "resume"  # continues an aborted generation from its partial output
    RESAMPLE = "resample"  # a new sample after an output whose tool call could not be read


class AttemptOutcome(enum.StrEnum):
    """How one attempt ended."""

    OK = "ok"
    ABORTED = "aborted"  # ended by /abort_request; its partial output is kept
    REFUSED = "refused"  # the engine provably did not accept it
    INDETERMINATE = "indeterminate"  # it may have run; never resent blindly
    FAILED = "failed"  # refused by the middleware (e.g. the version is gone) or a bad reply


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One generation request as the agent saw it."""

    session_id: str
    task_id: str
    turn: int
    attempt: int  # 1-based within the turn
    kind: AttemptKind
    rid: str
    outcome: AttemptOutcome
    lora_name: str | None  # the Session's bound version, as sent
    served_model: str | None  # the ``model`` the engine answered with (``<base>:<lora_name>``)
    engine: str | None
    started_at: float
    latency_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None
    text: str = ""
    error_code: str | None = None
    error: str | None = None
    http_status: int | None = None
    # Publications the default was ahead of the bound version when this attempt started (only
    # for attempts that got a reply; None when unknown).
    version_lag: int | None = None

    @property
    def logprob(self) -> float:
        """Sum of the sampled tokens' logprobs (0.0 when none were returned)."""
        return float(sum(self.token_logprobs))


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One turn: its attempts, the text it ended with and the tools it called."""

    turn: int
    attempts: tuple[AttemptRecord, ...]
    text: str
    calls: tuple[ToolCall, ...] = ()
    results: tuple[ToolResult, ...] = ()

    @property
    def tool_source(self) -> str | None:
        """``"model"`` or ``"policy"`` for a tool turn, None for the final answer."""
        return self.calls[0].source if self.calls else None


class EpisodeStatus(enum.StrEnum):
    """How an episode ended."""

    ANSWERED = "answered"  # a turn without a tool call: the final answer
    MAX_TURNS = "max_turns"
    REFUSED = "refused"  # a generation was refused and could not be retried
    INDETERMINATE = "indeterminate"  # a generation may have run; not resent
    INTERRUPTED = "interrupted"  # aborted more often than the resume budget allows
    FAILED = "failed"  # the middleware refused the Session (closed, version gone, ...)


@dataclass(frozen=True, slots=True)
class Episode:
    """The outcome of :meth:`ToolAgent.run`."""

    session_id: str
    task_id: str
    status: EpisodeStatus
    turns: tuple[TurnRecord, ...]
    lora_name: str | None
    answer: str | None = None
    error_code: str | None = None
    # The Session's ``provenance()`` when the episode ended (JSON-able; None if not taken).
    provenance: Mapping[str, Any] | None = None

    @property
    def attempts(self) -> tuple[AttemptRecord, ...]:
        """Every attempt of every turn, in order."""
        return tuple(a for t in self.turns for a in t.attempts)

    @property
    def observations(self) -> tuple[str, ...]:
        """Every tool observation, in order."""
        return tuple(r.observation for t in self.turns for r in t.results)

    @property
    def lora_names(self) -> frozenset[str]:
        """Every version the Session's requests carried (one, for a correct Session)."""
        return frozenset(a.lora_name for a in self.attempts if a.lora_name is not None)
