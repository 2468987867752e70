"""Run agent episodes on a live engine fleet: ``python -m agentic_lora_agent --help``.

Publishes one adapter directory (HTTP push; idempotent across runs with a registry journal),
runs ``--sessions`` concurrent episodes over the chosen tasks, prints one line per Session and the
latency percentiles, and exits non-zero if an episode did not end with an answer or a Session saw
more than one version.
Engine and middleware options are the framework's own ``--versioned-lora-*`` flags (or
``AGENTIC_LORA_*`` environment variables).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import add_arguments
from agentic_lora.config import from_args
from agentic_lora.errors import AgenticLoRAError
from agentic_lora_agent.agent import AgentConfig
from agentic_lora_agent.agent import ToolAgent
from agentic_lora_agent.policy import FallbackPolicy
from agentic_lora_agent.policy import ScriptedPolicy
from agentic_lora_agent.records import Episode
from agentic_lora_agent.records import EpisodeStatus
from agentic_lora_agent.stats import episode_json
from agentic_lora_agent.stats import episode_line
from agentic_lora_agent.stats import percentiles
from agentic_lora_agent.tasks import TASKS
from agentic_lora_agent.tasks import default_toolbox
from agentic_lora_agent.tasks import task

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m agentic_lora_agent",
        description="Run agent episodes on a live engine fleet.",
    )
    parser.add_argument(
        "--publish",
        required=True,
        metavar="VERSION_ID=DIR",
        help="a PEFT adapter directory to publish (with a journal: found again on a rerun)",
    )
    parser.add_argument(
        "--store-root",
        required=True,
        type=Path,
        help="absolute directory every engine can read (HTTP push writes versions there)",
    )
    parser.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated, from: {', '.join(TASKS)}"
    )
    parser.add_argument("--sessions", type=int, default=4, help="concurrent episodes")
    parser.add_argument(
        "--policy",
        choices=["none", "scripted"],
        default="none",
        help="fallback when an output has no parsable tool call: none (a real model; the text is "
        "the answer) or scripted (each task's fixed plan; for a model whose output is noise)",
    )
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON merged into every request, e.g. '{\"skip_special_tokens\": false}'",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="ask for every turn as a stream (each chunk names its version) and assemble it",
    )
    parser.add_argument("--json", type=Path, help="also write every episode here as JSON")
    return add_arguments(parser)


async def _run(args: argparse.Namespace) -> int:
    settings = from_args(args, enable_versioned_lora_publication=True)
    version_id, sep, directory = str(args.publish).partition("=")
    if not sep or not version_id or not directory:
        raise SystemExit("--publish takes VERSION_ID=DIR")
    chosen = [task(t.strip()) for t in str(args.tasks).split(",") if t.strip()]
    if not chosen or args.sessions < 1:
        raise SystemExit("need at least one task and one session")
    config = AgentConfig(
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        extra_body=args.extra_body,
        stream=args.stream,
    )
    policy: FallbackPolicy | None = ScriptedPolicy() if args.policy == "scripted" else None
    tools = default_toolbox()
    store_root = str(args.store_root)
    async with Deployment.from_settings(settings, backend_options={"store_root": store_root}) as d:
        result = await d.publish(version_id, AdapterSnapshot.from_peft_dir(directory))
        print(f"published {result.version_id}: {result.outcome.value} as {result.lora_name}")
        if not result.ok:
            return 1

        async def one(index: int) -> Episode:
            async with d.session(f"agent-{index}") as s:
                agent = ToolAgent(
                    s, chosen[index % len(chosen)], tools=tools, config=config, policy=policy
                )
                return await agent.run()

        episodes = await asyncio.gather(*(one(i) for i in range(args.sessions)))
    for episode in episodes:
        print(episode_line(episode), "| answer:", repr((episode.answer or "")[:60]))
    stats = percentiles(a.latency_s for e in episodes for a in e.attempts)
    if stats is not None:
        print(
            f"{stats.count} requests: p50 {stats.p50:.3f} s, p95 {stats.p95:.3f} s, "
            f"p99 {stats.p99:.3f} s"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([episode_json(e) for e in episodes], indent=2) + "\n")
    mixed = [e.session_id for e in episodes if len(e.lora_names) > 1]
    unanswered = [e.session_id for e in episodes if e.status is not EpisodeStatus.ANSWERED]
    if mixed:
        print(f"FAIL: Sessions that saw more than one version: {mixed}")
    if unanswered:
        print(f"episodes without an answer: {unanswered}")
    return 1 if mixed or unanswered else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run; the exit code (0: every episode answered, one version each)."""
    args = _parser().parse_args(argv)
    args.store_root = args.store_root.resolve()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_run(args))
    except AgenticLoRAError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
