"""``python -m agentic_lora_rollout``: the Ray rollout example on two SGLang engines.

Starts two engines serving the tiny fixture model (the test harness, as ``make demo`` does), a
local Ray cluster, and runs :func:`~agentic_lora_rollout.rollout` on them: the trainer publishes
fixture adapters A, B, C, A, ... as versions ``step-0``, ``step-1``, ... while the rollout worker
actors run agent episodes. Prints the publications, the episodes per version, the lags, and the
checks; exits 1 if a check failed, 2 on an error. The engines and Ray always stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from agentic_lora_harness.engine_env import ensure_engine_env
from agentic_lora_harness.engines import EngineFleet
from agentic_lora_harness.exit_status import failures_exit
from agentic_lora_harness.fixture import build_fixture

from .driver import REGISTRY_NAMESPACE
from .rollout import RolloutReport
from .rollout import rollout

#: The rollout's sizes, each an integer option: (flag, default, help).
_SIZES: tuple[tuple[str, int, str], ...] = (
    ("--workers", 2, "rollout worker actors (>= 2)"),
    ("--agents", 2, "concurrent agents per worker"),
    ("--publications", 3, "versions published (>= 2)"),
    ("--turns-between", 6, "answered turns per worker between two publications"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agentic_lora_rollout",
        description="Ray rollout workers running agent Sessions while the trainer publishes",
    )
    for flag, default, help_text in _SIZES:
        p.add_argument(flag, type=int, default=default, help=help_text)
    p.add_argument(
        "--max-version-lag",
        type=int,
        help="the workers' --versioned-lora-max-version-lag (default: no bound)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="journal, adapter store and episodes.jsonl (default: beside the engine logs)",
    )
    return p


def _print(report: RolloutReport) -> None:
    print("\nPublications")
    for p in report.publications:
        print(f"  {p.version_id}: {p.outcome.value} ({p.lora_name})")
    print("\nEpisodes per bound version")
    for version, count in sorted(report.versions_used().items()):
        print(f"  {version}: {count}")
    lags = Counter(
        lag for ep in report.episodes for lag in (ep["provenance"] or {}).get("lags", [])
    )
    print("\nTurns per lag: " + ", ".join(f"{k}: {v}" for k, v in sorted(lags.items())))
    print(f"Episodes refused VERSION_TOO_STALE: {report.too_stale()}")
    print(f"Episodes with provenance: {report.episodes_path}")
    problems = report.problems()
    print("\nChecks: " + ("all passed" if not problems else f"{len(problems)} failed"))
    for problem in problems:
        print(f"  FAIL {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.workers < 2 or args.publications < 2:
        raise SystemExit("need at least 2 workers and 2 publications")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import ray

    env = ensure_engine_env()
    fixture = build_fixture()
    letters = ["A", "B", "C"]
    adapters = [fixture.adapter(letters[i % 3]) for i in range(args.publications)]
    print("starting two SGLang engines ...", flush=True)
    with failures_exit("rollout"), EngineFleet(env, fixture, count=2) as fleet:
        workdir = args.workdir or fleet.log_dir / "ray-rollout"
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            namespace=REGISTRY_NAMESPACE,
            log_to_driver=False,
        )
        try:
            report = asyncio.run(
                rollout(
                    dict(fleet.engines),
                    base_model=fleet.served_model_name,
                    adapters=adapters,
                    workdir=workdir,
                    workers=args.workers,
                    agents=args.agents,
                    turns_between=args.turns_between,
                    max_version_lag=args.max_version_lag,
                )
            )
        finally:
            ray.shutdown()
    _print(report)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
