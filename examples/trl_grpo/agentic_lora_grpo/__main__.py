"""``python -m agentic_lora_grpo``: TRL GRPO on two SGLang engines through agentic-lora.

Starts two engines serving the tiny fixture model (the test harness, as ``make demo`` does) and
runs :func:`~agentic_lora_grpo.train` on them: ``GRPOTrainer`` trains a LoRA for ``--steps``
optimizer steps, each trajectory one Session, the adapter published every ``--publish-every``
steps. Prints the publications, the trajectories per version, the lags and the checks; exits 1
if a check failed, 2 on an error. The engines always stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from agentic_lora_harness.engine_env import ensure_engine_env
from agentic_lora_harness.engines import EngineFleet
from agentic_lora_harness.exit_status import failures_exit
from agentic_lora_harness.fixture import build_fixture
from agentic_lora_trl import DeploymentThread

from agentic_lora import load_settings

from .train import TrainReport
from .train import train


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agentic_lora_grpo",
        description="TRL GRPOTrainer generating through Sessions and publishing through versions",
    )
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--publish-every", type=int, default=1, help="steps between publications")
    p.add_argument(
        "--max-version-lag", type=int, default=1, help="the Sessions' max_version_lag (default 1)"
    )
    p.add_argument("--workdir", type=Path, help="adapter store and trainer output")
    return p


def _print(report: TrainReport) -> None:
    stats = report.stats
    print(
        f"\nPublications: {stats.published} published, {stats.coalesced} coalesced, "
        f"{stats.skipped} skipped, {stats.failed} failed; the default at the end: "
        f"{report.final_default}"
    )
    print("\nTrajectories per bound version")
    for version, count in sorted(report.versions_used().items()):
        print(f"  {version}: {count}")
    provenances = [t["agentic_lora"] for t in report.trajectories()]
    lags = Counter(lag for p in provenances for lag in p["lags"])
    print("Turns per lag: " + ", ".join(f"{k}: {v}" for k, v in sorted(lags.items())))
    print(f"Trajectories restarted as too stale: {sum(len(p['restarts']) for p in provenances)}")
    rewards = [h["reward"] for h in report.trainer.state.log_history if "reward" in h]
    print("Mean reward per step: " + ", ".join(f"{r:.4f}" for r in rewards))
    problems = report.problems()
    print("\nChecks: " + ("all passed" if not problems else f"{len(problems)} failed"))
    for problem in problems:
        print(f"  FAIL {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    env = ensure_engine_env()
    fixture = build_fixture()
    print("starting two SGLang engines ...", flush=True)
    with failures_exit("GRPO example"), EngineFleet(env, fixture, count=2) as fleet:
        settings = load_settings(
            enable_versioned_lora_publication=True,
            engines=[f"{name}={url}" for name, url in fleet.engines],
            capacity=2,
            base_model_name=fleet.served_model_name,
            engine_max_loaded_loras=3,
            engine_max_loras_per_batch=3,
            max_version_lag=args.max_version_lag,
        )
        workdir = args.workdir or fleet.log_dir / "trl-grpo"
        store = workdir / "adapter-store"  # the engines read it at the same path
        with DeploymentThread.from_settings(
            settings, backend_options={"store_root": str(store)}
        ) as thread:
            report = train(
                thread,
                model_dir=fixture.model_dir,
                workdir=workdir,
                steps=args.steps,
                publish_every=args.publish_every,
            )
    _print(report)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
