"""Draw the benchmark plots (PNG, matplotlib) into ``docs/img/`` from ``bench/out/*.json``.

* ``dispatch_overhead.png``: what a versioned dispatch adds over a direct httpx call (client CPU
  per dispatch and p50 latency, instant engine; p50 ratio, real SGLang) and where our part of it
  goes (each step timed in isolation).
* ``publication_timeline.png``: every agent request over time, coloured by the version it ran
  on, with the publication windows, commits and reclaims; Session refs per version from the
  registry; request latency by completion time.
* ``memory_rss.png``: RSS over the million Session open/close cycles.
* ``recovery.png``: per fault kind (``bench/chaos.py``), every run's time from the kill -9 to the
  killed part running again, to the first committed publication and to the first successful
  generation of an affected Session, with the issue's goals drawn where they apply.
* ``policy_mixing.png``: in-place swap, drain before swap and versioned pinning side by side
  (``bench/policy_mixing.py``; drawn by ``bench/plot_mixing.py``).

A plot whose JSON is missing is skipped with a note. Usage: python bench/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from common import OUT_DIR
from common import REPO_ROOT
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter
from plot_mixing import plot_policy_mixing

__all__ = [
    "main",
    "plot_dispatch",
    "plot_memory",
    "plot_mixing",
    "plot_publication",
    "plot_recovery",
]

IMG_DIR = REPO_ROOT / "docs" / "img"
VARIANT_COLOURS = {
    "direct": "#7f7f7f",
    "transport": "#1f77b4",
    "passthrough": "#2ca02c",
    "full": "#d62728",
}
# Steps that are a part of a larger step listed above them in the breakdown.
STEP_PARTS = frozenset(
    {
        "shape_check",
        "full_validation_not_done_pydantic",
        "rid_counter",
        "rid_uuid4_not_done",
        "pin_adapter",
        "guard_check",
        "router_choose",
        "call_copy",
    }
)
VERSION_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _load(name: str) -> dict[str, Any] | None:
    path = OUT_DIR / f"{name}.json"
    if not path.exists():
        print(f"skipped: {path} not found (run the benchmark that writes it first)")
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _save(fig: Figure, name: str) -> Path:
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    path = IMG_DIR / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"written: {path}")
    return path


# --- dispatch ------------------------------------------------------------------------------------


def _sessions(level: str) -> str:
    return f"{level} Session" if level == "1" else f"{level} Sessions"


def _grouped_bars(
    ax: Axes, levels: list[str], variants: list[str], values: dict[str, list[float]]
) -> None:
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        xs = [x + (i - (len(variants) - 1) / 2) * width for x in range(len(levels))]
        ax.bar(xs, values[v], width, label=v, color=VARIANT_COLOURS.get(v))
    ax.set_xticks(range(len(levels)), levels)


def plot_dispatch() -> Path | None:
    """Three panels: instant-engine CPU/dispatch, instant p50 latency, SGLang ratio; plus steps."""
    instant = _load("dispatch_instant")
    sglang = _load("dispatch_sglang")
    if instant is None and sglang is None:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8), layout="constrained")
    if instant is not None:
        report = instant["report"]
        levels = list(report)
        variants = list(report[levels[0]]["variants"])
        cpu = {
            v: [report[c]["variants"][v]["client_cpu_us_per_dispatch"] for c in levels]
            for v in variants
        }
        _grouped_bars(axes[0], [_sessions(c) for c in levels], variants, cpu)
        axes[0].set_title("instant engine: client CPU per dispatch")
        axes[0].set_ylabel("microseconds")
        axes[0].legend(fontsize=8)
        # p50 latency on a log axis: queueing at 64/256 Sessions dwarfs the single-Session cost.
        p50 = {v: [report[c]["variants"][v]["latency_us"]["p50"] for c in levels] for v in variants}
        _grouped_bars(axes[1], [_sessions(c) for c in levels], variants, p50)
        axes[1].set_yscale("log")
        axes[1].set_title("instant engine: p50 latency per dispatch")
        axes[1].set_ylabel("microseconds (log)")
        steps = instant.get("breakdown_us") or {}
        names = list(steps)
        axes[3].barh(
            [f"   {n}" if n in STEP_PARTS else n for n in names],
            [steps[n] for n in names],
            color=["#f4a6a6" if n in STEP_PARTS else "#d62728" for n in names],
        )
        axes[3].invert_yaxis()
        axes[3].set_title("our steps in isolation (light: part of the bar above)")
        axes[3].set_xlabel("microseconds per dispatch")
        axes[3].tick_params(axis="y", labelsize=8)
    for ax, missing in ((axes[0], instant is None), (axes[2], sglang is None)):
        if missing:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
    if instant is None:
        axes[1].set_axis_off()
        axes[3].set_axis_off()
    if sglang is not None:
        report = sglang["report"]
        levels = list(report)
        kinds = {
            "all dispatches": "ratio_of_medians",
            "first of a Session": "first_ratio_of_medians",
            "later ones": "later_ratio_of_medians",
        }
        width = 0.8 / len(kinds)
        shown: list[float] = []
        for i, (label, key) in enumerate(kinds.items()):
            ratios = [report[c]["variants"]["full"].get(key, float("nan")) for c in levels]
            shown += [r for r in ratios if r == r]
            xs = [x + (i - (len(kinds) - 1) / 2) * width for x in range(len(levels))]
            # Bars start at 1.0, so their length is the overhead (or saving) itself.
            axes[2].bar(xs, [r - 1 for r in ratios], width, bottom=1.0, label=label,
                        color=("#d62728", "#f4a6a6", "#8c1c13")[i])  # fmt: skip
        axes[2].set_xticks(range(len(levels)), [_sessions(c) for c in levels])
        axes[2].axhline(1.05, color="black", linestyle="--", linewidth=1, label="target 1.05")
        axes[2].axhline(1.0, color="#7f7f7f", linewidth=0.8)
        axes[2].set_ylim(min([0.9, *shown]) - 0.02, max([1.1, *shown]) + 0.02)
        axes[2].set_title("real SGLang: p50 full / p50 direct")
        axes[2].legend(fontsize=8)
    fig.suptitle("Dispatch overhead: versioned Session vs direct httpx call (one interleaved run)")
    return _save(fig, "dispatch_overhead.png")


# --- publication under load ------------------------------------------------------------------


def _version_colours(requests: list[dict[str, Any]]) -> dict[str, str]:
    order: list[str] = []
    for r in sorted(requests, key=lambda r: r["start"]):
        if r["version"] not in order:
            order.append(r["version"])
    return {v: VERSION_COLOURS[i % len(VERSION_COLOURS)] for i, v in enumerate(order)}


def plot_publication() -> Path | None:
    """Requests per agent by version, Session refs per version, latency over time."""
    data = _load("publication_under_load")
    if data is None:
        return None
    tl = data["timeline"]
    requests = tl["requests"]
    colours = _version_colours(requests)
    fig, (gantt, refs, lat) = plt.subplots(
        3, 1, figsize=(14, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    for ax in (gantt, refs, lat):
        for w in data["windows"]:
            if w["kind"] == "publication":
                ax.axvspan(w["start"], w["end"], color="#ffe8cc", zorder=0)
        for p in data["publications"]:
            ax.axvline(p["commit_at"], color="black", linestyle="--", linewidth=0.8)
            if p["reclaimed_at"] is not None:
                ax.axvline(p["reclaimed_at"], color="#d62728", linestyle=":", linewidth=1)
    for r in requests:
        failed = r["outcome"] != "ok"
        gantt.plot(
            [r["start"], r["end"]],
            [r["agent"], r["agent"]],
            color="black" if failed else colours.get(r["version"], "grey"),
            linewidth=6,
            solid_capstyle="butt",
        )
    gantt.set_ylabel("agent")
    gantt.set_ylim(-0.6, max((r["agent"] for r in requests), default=0) + 1.6)
    gantt.set_title(
        "Every request, coloured by the version its Session is bound to "
        "(shaded: publication windows; dashed: commit; dotted red: retired version reclaimed)"
    )
    handles = [Patch(color=c, label=v) for v, c in colours.items()]
    gantt.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))

    samples = tl["registry"]
    ids = sorted({v for s in samples for v in s["versions"]})
    short = {v: v.split("-")[0] for v in ids}
    for v in ids:
        ts = [s["t"] for s in samples]
        ys = [s["versions"].get(v, {}).get("refs", 0) for s in samples]
        refs.step(ts, ys, where="post", label=short[v], color=colours.get(short[v], "grey"))
    refs.set_ylabel("Sessions bound")
    refs.set_title("Session refs per version (registry, sampled every 0.1 s)")

    ok = [r for r in requests if r["outcome"] == "ok"]
    lat.scatter(
        [r["end"] for r in ok],
        [r["end"] - r["start"] for r in ok],
        s=6,
        c=[colours.get(r["version"], "grey") for r in ok],
    )
    lat.set_ylabel("latency (s)")
    lat.set_xlabel("seconds since agent traffic started")
    lat.set_title("Request latency by completion time")
    return _save(fig, "publication_timeline.png")


# --- memory --------------------------------------------------------------------------------------


def plot_memory() -> Path | None:
    """RSS over the cycles, with the 20 MiB growth budget drawn from the starting RSS."""
    data = _load("memory")
    if data is None:
        return None
    series = data["series"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([s["cycles"] for s in series], [s["rss_mb"] for s in series], marker="o", markersize=3)
    start = data["rss_start_mb"]
    ax.axhline(start + 20, color="#d62728", linestyle="--", linewidth=1, label="start + 20 MiB")
    ax.set_ylim(0, max(start + 30, max(s["rss_mb"] for s in series) + 10))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlabel("Session open/close cycles (through Versioning)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(
        f"RSS over {data['cycles']:,} Session cycles: "
        f"{data['growth_total_mb']:+.1f} MiB in total, "
        f"{data['growth_after_warmup_mb']:+.1f} MiB after the first {data['warmup_cycles']:,}"
    )
    ax.legend()
    return _save(fig, "memory_rss.png")


# --- recovery ------------------------------------------------------------------------------------

RECOVERY_TIMES = (
    ("back_s", "killed part runs again", "#7f7f7f"),
    ("first_publication_s", "first committed publication", "#1f77b4"),
    ("first_affected_generation_s", "first generation of an affected Session", "#2ca02c"),
    ("slots_back_s", "slots back (worker)", "#ff7f0e"),
    (
        "restart_releases_s",
        "restart released the old lease (worker, from its process start)",
        "#9467bd",
    ),
)
FAULT_LABELS = {
    "engine": "engine restart",
    "gateway": "gateway process",
    "registry-host": "registry host\n(inside a publication)",
    "worker": "rollout worker",
    "registry-actor": "registry actor (Ray)",
}


def plot_recovery() -> Path | None:
    """Each run's recovery times per fault kind (dots), medians (bars), goals (red ticks)."""
    data = _load("chaos")
    if data is None:
        return None
    runs = data["runs"]
    kinds = [k for k in FAULT_LABELS if any(r["kind"] == k for r in runs)]
    fig, ax = plt.subplots(figsize=(12, 1.6 + 1.3 * len(kinds)))
    height = 0.8 / len(RECOVERY_TIMES)
    for j, (key, label, colour) in enumerate(RECOVERY_TIMES):
        for i, kind in enumerate(kinds):
            values = [r[key] for r in runs if r["kind"] == kind and r.get(key) is not None]
            if not values:
                continue
            y = i + (j - (len(RECOVERY_TIMES) - 1) / 2) * height
            values.sort()
            ax.barh(y, values[len(values) // 2], height, color=colour, alpha=0.35,
                    label=label if i == next(
                        n for n, k in enumerate(kinds)
                        if any(r["kind"] == k and r.get(key) is not None for r in runs)
                    ) else None)  # fmt: skip
            ax.scatter(values, [y] * len(values), color=colour, s=14, zorder=3)
    goals: dict[str, list[float]] = {}
    for r in runs:
        if r["kind"] == "engine" and r.get("back_s") is not None:
            goals.setdefault("engine", []).append(r["back_s"] + 5.0)
    ttl = data.get("settings", {}).get("lease_ttl", 5.0)
    if "worker" in kinds:
        goals["worker"] = [ttl + 5.0]
    for i, kind in enumerate(kinds):
        for g in goals.get(kind, []):
            ax.plot([g, g], [i - 0.45, i + 0.45], color="#d62728", linewidth=1.5)
    ax.plot([], [], color="#d62728", label="goal: engine back + 5 s / lease TTL + 5 s")
    ax.set_yticks(range(len(kinds)), [FAULT_LABELS[k] for k in kinds])
    ax.invert_yaxis()
    # Log scale: an engine's restart (minutes on CPU) and the rest (seconds) on one axis.
    ax.set_xscale("log")
    ax.set_xlim(left=0.1)
    ax.set_xlabel("seconds after the kill -9, log scale (bars: median; dots: every run)")
    ax.set_title(
        f"Recovery per fault kind ({data['settings']['repeat']} runs each, "
        "two SGLang engines on a 2-core CPU machine)"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, "recovery.png")


def plot_mixing() -> Path | None:
    """In-place swap, drain and versioned pinning (see ``bench/plot_mixing.py``)."""
    data = _load("policy_mixing")
    if data is None:
        return None
    path = plot_policy_mixing(data, IMG_DIR / "policy_mixing.png")
    print(f"written: {path}")
    return path


def main() -> None:
    """Draw every plot whose data exists."""
    plot_dispatch()
    plot_publication()
    plot_memory()
    plot_recovery()
    plot_mixing()


if __name__ == "__main__":
    main()
