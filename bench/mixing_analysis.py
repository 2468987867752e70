"""The pure parts of ``bench/policy_mixing.py``: workload, version attribution, the figures.

Nothing here does I/O or reads a clock, so every rule is unit-tested on its own
(``tests/bench/test_mixing_analysis.py``). Times are seconds on one segment's clock.

* :func:`plan_trajectory`: one agent trajectory (turn count, tool waits, tool outputs) from a
  seed; the same (seed, repeat, agent, index) gives the same plan to every strategy.
* :func:`identify`: the adapter content a turn ran on, from the input-token logprobs of the
  prompt's fixed prefix (a causal LM's logprob of a prefix token depends on the prefix and the
  weights only), against reference fingerprints taken on an idle engine.
* :func:`timeline_version`: the version an in-place swap timeline implies for a turn on one
  engine, or :data:`AT_RISK` when the turn overlaps a swap window on its engine.
* :func:`count_mixing`: trajectories whose turns ran on more than one version.
* :func:`throughput`, :func:`max_gap` (from ``common``), :func:`first_completion_on`,
  :func:`version_lags`, :func:`operator_capacity`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from typing import Literal

import numpy as np

__all__ = [
    "AT_RISK",
    "Mixing",
    "Publication",
    "SwapWindow",
    "TrajectoryPlan",
    "Turn",
    "WorkloadSpec",
    "count_mixing",
    "duration_quantile",
    "first_completion_on",
    "identify",
    "live_version",
    "operator_capacity",
    "plan_trajectory",
    "throughput",
    "timeline_version",
    "version_lags",
]

AT_RISK: Final = "at-risk"
"""A turn that overlapped a swap window on its engine: the timeline cannot say its version."""

TimelineVersion = int | Literal["at-risk"]

# The repeat number of the plans drawn for sizing: a stream no run's repeat uses.
_SIZING_STREAM: Final = 1 << 30

_WORDS: Final = (
    "city", "weather", "search", "result", "file", "read", "sum", "value", "list", "json",
    "query", "answer", "tool", "error", "retry", "done", "number", "name", "unit", "step",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What a trajectory looks like: turns drawn uniformly in ``[min_turns, max_turns]``, a tool
    wait after every turn but the last from a long-tailed distribution (``lognormal``: median
    ``wait_median`` s, shape ``wait_sigma``; ``pareto``: scale ``wait_median`` s, tail index
    ``wait_alpha``), capped at ``wait_cap`` s."""

    min_turns: int = 2
    max_turns: int = 8
    wait: Literal["lognormal", "pareto"] = "lognormal"
    wait_median: float = 0.4
    wait_sigma: float = 1.2
    wait_alpha: float = 1.5
    wait_cap: float = 30.0
    tool_words: int = 6

    def __post_init__(self) -> None:
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        if self.wait_median <= 0 or self.wait_sigma <= 0 or self.wait_alpha <= 0:
            raise ValueError("wait parameters must be positive")
        if self.wait_cap <= 0:
            raise ValueError("wait_cap must be positive")


@dataclass(frozen=True, slots=True)
class TrajectoryPlan:
    """One trajectory: its task text, and per turn the tool wait and tool output after it."""

    task: str
    waits: tuple[float, ...]  # one per turn but the last
    tool_outputs: tuple[str, ...]  # same length as waits

    @property
    def turns(self) -> int:
        return len(self.waits) + 1


def _rng(seed: int, repeat: int, agent: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, repeat, agent, index])


def _wait(rng: np.random.Generator, spec: WorkloadSpec) -> float:
    if spec.wait == "lognormal":
        value = float(rng.lognormal(math.log(spec.wait_median), spec.wait_sigma))
    else:  # classic Pareto with scale wait_median: wait_median * (1 + Lomax)
        value = spec.wait_median * (1.0 + float(rng.pareto(spec.wait_alpha)))
    return min(value, spec.wait_cap)


def _words(rng: np.random.Generator, count: int) -> str:
    return " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), size=count))


def plan_trajectory(
    spec: WorkloadSpec, *, seed: int, repeat: int, agent: int, index: int
) -> TrajectoryPlan:
    """The ``index``-th trajectory of ``agent`` in ``repeat``: a function of its arguments only."""
    rng = _rng(seed, repeat, agent, index)
    turns = int(rng.integers(spec.min_turns, spec.max_turns + 1))
    task = _words(rng, spec.tool_words)
    waits = tuple(_wait(rng, spec) for _ in range(turns - 1))
    outputs = tuple(_words(rng, spec.tool_words) for _ in range(turns - 1))
    return TrajectoryPlan(task, waits, outputs)


def duration_quantile(
    spec: WorkloadSpec, *, turn_seconds: float, q: float, seed: int, samples: int = 20_000
) -> float:
    """The ``q`` quantile of a trajectory's duration (turns x ``turn_seconds`` plus its tool
    waits), by Monte Carlo over ``samples`` plans drawn as the run draws them."""
    durations = [
        p.turns * turn_seconds + sum(p.waits)
        for p in (
            plan_trajectory(spec, seed=seed, repeat=_SIZING_STREAM, agent=0, index=i)
            for i in range(samples)
        )
    ]
    return float(np.quantile(durations, q))


def operator_capacity(duration: float, cadence: float) -> int:
    """Version slots an operator provisions: the default, one candidate being published, and
    every retired version a trajectory of ``duration`` seconds can still hold when publications
    come every ``cadence`` seconds (``ceil(duration / cadence)`` of them)."""
    if duration < 0 or cadence <= 0:
        raise ValueError("need duration >= 0 and cadence > 0")
    return 2 + math.ceil(duration / cadence)


# --- records -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One generation of one trajectory, as the agent saw it.

    ``fingerprint``: the engine's input-token logprobs of the fixed prompt prefix (None when the
    turn failed). ``named_version``: the version the request named by its ``lora_path`` when
    that name is immutable (versioned pinning); None for a fixed in-place name.
    """

    trajectory: str
    agent: int
    index: int
    engine: str
    dispatched: float
    finished: float
    ok: bool
    fingerprint: tuple[float, ...] | None = None
    named_version: int | None = None


@dataclass(frozen=True, slots=True)
class SwapWindow:
    """One engine's in-place swap to ``version``: from the unload call to the load's answer."""

    engine: str
    version: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Publication:
    """One trainer publication of ``version``: the call and its return (trainer-visible)."""

    version: int
    called: float
    returned: float
    ok: bool
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.returned - self.called


# --- attribution ---------------------------------------------------------------------------------


def identify(
    fingerprint: Sequence[float] | None,
    references: Mapping[int, Sequence[float]],
    *,
    tolerance: float = 0.02,
    margin: float = 0.25,
) -> int | None:
    """The reference whose fingerprint ``fingerprint`` matches, else None.

    Distance is the mean absolute difference over the positions both have. A match needs a
    distance within ``tolerance`` and below ``margin`` times the second-nearest reference's
    distance; anything else (no fingerprint, too far from all, two candidates alike) is
    unidentified and reported as such, never guessed.
    """
    if fingerprint is None or not references:
        return None
    scored: list[tuple[float, int]] = []
    for key, ref in references.items():
        n = min(len(ref), len(fingerprint))
        if n == 0:
            continue
        scored.append((sum(abs(a - b) for a, b in zip(fingerprint, ref, strict=False)) / n, key))
    if not scored:
        return None
    scored.sort()
    best, key = scored[0]
    if best > tolerance:
        return None
    if len(scored) > 1 and best >= margin * scored[1][0]:
        return None
    return key


def timeline_version(
    turn: Turn, windows: Iterable[SwapWindow], *, initial: int = 0
) -> TimelineVersion:
    """The version an in-place swap timeline implies for ``turn``.

    A turn dispatched after its engine's swap to version k ended and finished before the next
    swap on that engine began ran on version k; a turn whose span overlaps a swap window on its
    engine is :data:`AT_RISK` (the engine may have served it the old weights, the new ones, or a
    silent reload). Swaps on other engines do not touch it.
    """
    version = initial
    latest_end = -math.inf
    for w in windows:
        if w.engine != turn.engine:
            continue
        if w.start < turn.finished and w.end > turn.dispatched:
            return AT_RISK
        if w.end <= turn.dispatched and w.end > latest_end:
            version, latest_end = w.version, w.end
    return version


@dataclass(frozen=True, slots=True)
class Mixing:
    """Trajectories by the versions their turns ran on.

    ``mixed``: two or more distinct known versions. ``at_risk``: one known version (or none) and
    at least one turn of unknown version (a turn the attribution could not place), so mixing
    cannot be ruled out. ``clean``: every turn known, all one version.
    """

    trajectories: int
    mixed: int
    at_risk: int
    clean: int

    @property
    def mixed_fraction(self) -> float:
        return self.mixed / self.trajectories if self.trajectories else math.nan

    @property
    def mixed_or_at_risk_fraction(self) -> float:
        return (self.mixed + self.at_risk) / self.trajectories if self.trajectories else math.nan


def count_mixing(versions: Mapping[str, Sequence[int | None]]) -> Mixing:
    """Classify each trajectory (id -> its turns' versions, None for unknown) as in :class:`Mixing`."""
    mixed = at_risk = clean = 0
    for turns in versions.values():
        known = {v for v in turns if v is not None}
        if len(known) > 1:
            mixed += 1
        elif any(v is None for v in turns):
            at_risk += 1
        else:
            clean += 1
    return Mixing(len(versions), mixed, at_risk, clean)


# --- figures -------------------------------------------------------------------------------------


def throughput(finished: Iterable[float], start: float, end: float) -> float:
    """Completions per second inside ``[start, end]``."""
    if end <= start:
        raise ValueError("empty window")
    return sum(1 for t in finished if start <= t <= end) / (end - start)


def first_completion_on(
    turns: Iterable[tuple[float, int | None]], version: int, after: float
) -> float:
    """Seconds from ``after`` to the first completion (``(finished, version)`` pairs) of a turn
    that ran on ``version`` and finished after ``after``; NaN when none did."""
    times = [t for t, v in turns if v == version and t >= after]
    return min(times) - after if times else math.nan


def live_version(publications: Sequence[Publication], at: float, *, initial: int = 0) -> int:
    """The newest version whose publication had returned successfully by ``at``."""
    newest = initial
    for p in publications:
        if p.ok and p.returned <= at:
            newest = max(newest, p.version)
    return newest


def version_lags(
    turns: Iterable[tuple[float, int | None]],
    publications: Sequence[Publication],
    *,
    initial: int = 0,
) -> list[int]:
    """Per turn of known version (``(dispatched, version)`` pairs): how many versions behind the
    newest published one at its dispatch it ran (0: the newest; never negative)."""
    return [
        max(0, live_version(publications, t, initial=initial) - v)
        for t, v in turns
        if v is not None
    ]
