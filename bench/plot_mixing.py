"""The policy-mixing figure (``bench/policy_mixing.py``'s JSON): one timeline per strategy and the
measured figures side by side.

Top: the first repeat of each strategy, one row per agent, every turn a bar coloured by the
version its output identifies (grey: unidentified, black: failed); a red dot ends each
trajectory that mixed versions; shaded: the trainer's publication calls (call to return).
Bottom: per strategy, every repeat's value as a dot and the median as a bar: mixed
trajectories, trainer-visible publication time (log scale), throughput, turns per CPU-second
the run's processes got (the machine is shared), longest no-progress gap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["plot_policy_mixing"]

STRATEGY_COLOURS = {"inplace": "#d62728", "drain": "#7f7f7f", "pinned": "#1f77b4"}
TITLES = {
    "inplace": "in-place swap of one fixed adapter name",
    "drain": "drain before swap",
    "pinned": "versioned pinning (agentic-lora)",
}


# tab10 without its grey, which stands for "unidentified" here.
VERSION_COLOURS = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]


def _gantt(ax: Any, tl: dict[str, Any], window_end: float) -> None:
    turns = tl["turns"]
    by_traj: dict[str, set[int | None]] = {}
    ends: dict[str, tuple[float, int]] = {}
    for t in turns:
        if t["ok"]:
            by_traj.setdefault(t["trajectory"], set()).add(t["version"])
        end = ends.get(t["trajectory"], (-1.0, t["agent"]))
        ends[t["trajectory"]] = (max(end[0], t["finished"]), t["agent"])
        colour = (
            "black"
            if not t["ok"]
            else (
                "#bbbbbb"
                if t["version"] is None
                else VERSION_COLOURS[t["version"] % len(VERSION_COLOURS)]
            )
        )
        ax.plot(
            [t["dispatched"], t["finished"]],
            [t["agent"], t["agent"]],
            color=colour,
            linewidth=5,
            solid_capstyle="butt",
        )
    starts = [(t["dispatched"], t["agent"]) for t in turns if t["index"] == 0]
    ax.scatter(
        [x for x, _ in starts],
        [y for _, y in starts],
        marker="|",
        s=60,
        color="black",
        linewidths=0.8,
    )
    for p in tl["publications"]:
        ax.axvspan(p["called"], p["returned"], color="#ffd8a8", zorder=0)
    ax.axvline(window_end, color="black", linestyle="--", linewidth=0.8)
    mixed = [ends[k] for k, vs in by_traj.items() if len({v for v in vs if v is not None}) > 1]
    if mixed:
        ax.scatter(
            [m[0] for m in mixed],
            [m[1] for m in mixed],
            s=14,
            color="red",
            zorder=3,
            label="mixed trajectory ends",
        )
        ax.legend(loc="upper right", fontsize=7)
    ax.set_ylabel("agent")
    ax.set_title(
        f"{TITLES[tl['strategy']]} (repeat {tl['repeat']}; shaded: publication call to return; |: a trajectory starts; dashed: no new trajectory after)",
        fontsize=9,
    )


def _dots(
    ax: Any,
    rows: list[dict[str, Any]],
    strategies: list[str],
    key: Any,
    title: str,
    *,
    log: bool = False,
) -> None:
    for i, s in enumerate(strategies):
        values = [key(r) for r in rows if r["strategy"] == s]
        values = [v for v in values if v == v]
        if values:
            ax.bar(i, float(np.median(values)), color=STRATEGY_COLOURS[s], alpha=0.5)
            ax.scatter([i] * len(values), values, color=STRATEGY_COLOURS[s], zorder=3, s=14)
    ax.set_xticks(range(len(strategies)), strategies)
    ax.set_title(title, fontsize=9)
    if log:
        ax.set_yscale("log")


def plot_policy_mixing(result: dict[str, Any], path: Path) -> Path:
    """Draw the figure for ``result`` into ``path`` (PNG) and return it."""
    rows = result["segments"]
    strategies = [
        s for s in ("inplace", "drain", "pinned") if any(r["strategy"] == s for r in rows)
    ]
    first = {tl["strategy"]: tl for tl in result["timelines"] if tl["repeat"] == 0}
    fig = plt.figure(figsize=(14, 4 + 2.6 * len(first)))
    grid = fig.add_gridspec(len(first) + 1, 5, height_ratios=[*([2.6] * len(first)), 2.2])
    top = None
    for i, s in enumerate(s for s in strategies if s in first):
        ax = fig.add_subplot(grid[i, :], sharex=top)
        top = top or ax
        settings = result["settings"]
        _gantt(ax, first[s], settings["warmup"] + settings["window"])
    if top is not None:
        top.figure.axes[-1].set_xlabel("seconds since the segment's agents started")
    panels = [
        (lambda r: r["mixed_fraction"], "trajectories that mixed versions"),
        (lambda r: r["publication_s"]["mean"], "trainer-visible publication (s, log)"),
        (lambda r: r["throughput_turns_s"], "throughput (turns/s)"),
        (lambda r: r.get("turns_per_cpu_s", float("nan")), "turns per CPU-second the run got"),
        (lambda r: r["max_gap_s"], "longest no-progress gap (s)"),
    ]
    for j, (key, title) in enumerate(panels):
        _dots(fig.add_subplot(grid[len(first), j]), rows, strategies, key, title, log=j == 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
