"""Summaries of finished episodes: latency percentiles and one line per Session."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agentic_lora_agent.records import AttemptKind, AttemptOutcome, Episode

__all__ = ["Percentiles", "episode_line", "percentiles"]


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
