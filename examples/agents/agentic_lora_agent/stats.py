"""Summaries of finished episodes: latency percentiles and one line per Session."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentic_lora_agent.records import AttemptKind
from agentic_lora_agent.records import AttemptOutcome
from agentic_lora_agent.records import Episode

__all__ = ["Percentiles", "episode_json", "episode_line", "percentiles"]


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50/p95/p99 (inclusive method) of ``count`` samples, in the samples' unit."""

    count: int
    p50: float
    p95: float
    p99: float
    maximum: float


def percentiles(samples: Iterable[float]) -> Percentiles | None:
    """Percentiles of ``samples`` (None for no samples; one sample is every percentile)."""
    data = sorted(samples)
    if not data:
        return None
    if len(data) == 1:
        return Percentiles(1, data[0], data[0], data[0], data[0])
    cuts = statistics.quantiles(data, n=100, method="inclusive")
    return Percentiles(len(data), cuts[49], cuts[94], cuts[98], data[-1])


def _count(episode: Episode, kind: AttemptKind) -> int:
    return sum(1 for a in episode.attempts if a.kind is kind)


def episode_line(episode: Episode, *, short_names: Sequence[tuple[str, str]] = ()) -> str:
    """One readable line: Session, version, status, turns, engines, retries/resumes, tokens."""
    names = dict(short_names)
    versions = ",".join(sorted(names.get(n, n) for n in episode.lora_names)) or "-"
    engines = ",".join(sorted({a.engine for a in episode.attempts if a.engine})) or "-"
    ok = [a for a in episode.attempts if a.outcome is AttemptOutcome.OK]
    tokens = sum(a.completion_tokens for a in episode.attempts)
    sources = "".join(
        "M" if t.tool_source == "model" else "P" if t.tool_source == "policy" else "A"
        for t in episode.turns
    )
    return (
        f"{episode.session_id:<10} {versions:<4} {episode.status.value:<10} "
        f"turns={len(episode.turns)} [{sources}] requests={len(episode.attempts)} ok={len(ok)} "
        f"retry={_count(episode, AttemptKind.RETRY)} resume={_count(episode, AttemptKind.RESUME)} "
        f"resample={_count(episode, AttemptKind.RESAMPLE)} engines={engines} tokens={tokens}"
    )


def episode_json(episode: Episode) -> dict[str, Any]:
    """``episode`` as plain JSON-ready data (every attempt included, and the Session's
    provenance next to them: what a trainer stores with the trajectory)."""
    return {
        "session": episode.session_id,
        "task": episode.task_id,
        "status": episode.status.value,
        "lora_name": episode.lora_name,
        "answer": episode.answer,
        "error_code": episode.error_code,
        "observations": list(episode.observations),
        "provenance": dict(episode.provenance) if episode.provenance is not None else None,
        "attempts": [
            {
                "turn": a.turn,
                "attempt": a.attempt,
                "kind": a.kind.value,
                "outcome": a.outcome.value,
                "rid": a.rid,
                "lora_name": a.lora_name,
                "served_model": a.served_model,
                "engine": a.engine,
                "prompt_tokens": a.prompt_tokens,
                "completion_tokens": a.completion_tokens,
                "cached_tokens": a.cached_tokens,
                "latency_s": a.latency_s,
                "logprob": a.logprob,
                "finish_reason": a.finish_reason,
                "http_status": a.http_status,
                "error_code": a.error_code,
                "version_lag": a.version_lag,
            }
            for a in episode.attempts
        ],
    }
