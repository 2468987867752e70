"""A rollout worker process of the chaos suite's Ray topology: ``python -m tests.chaos.worker CFG``.

It is what a framework's rollout worker is: its own OS process, connected to the Ray cluster,
holding one :class:`~agentic_lora.session.Versioning` (the registry actor's client, the engine
transport, and the owner lease kept by its :class:`~agentic_lora.leases.LeaseKeeper`, owner id from
the config, stable across restarts of the same worker slot), and running example agents on its
Sessions (:class:`~tests.chaos.support.AgentLoad`). No publisher, no reclaimer: one process
publishes (the test).

``CFG`` is a JSON file: ``ray_address``, ``namespace``, ``registry_name``, ``journal``,
``engines`` (name -> base URL), ``base_model``, ``prefix``, ``owner``, ``lease_ttl``, ``agents``,
``events`` (a file this process appends JSON lines to: ``{"kind": "started", "incarnation",
"pid"}`` once its agents run, one ``{"kind": "lease", "event", "lease_id", ...}`` per change of
its owner lease (OPENED carries the registry's lease id), and one ``{"kind": "attempt", ...}`` per
generation attempt; times on the machine's monotonic clock). SIGTERM stops it cleanly (every Session closed, the lease closed);
SIGKILL is the fault.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from typing import TextIO

from agentic_lora.config import load_settings
from agentic_lora.registry.ray_actor import connect
from agentic_lora.session import Versioning
from tests.chaos.support import AgentLoad
from tests.chaos.support import VersioningSource
from tests.chaos.support import load_config

__all__ = ["main", "run"]


def _open_events(path: str) -> TextIO:
    return Path(path).open("a")


def _write(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record, separators=(",", ":")) + "\n")
    out.flush()


async def run(cfg: dict[str, Any]) -> None:
    import ray

    ray.init(
        address=cfg["ray_address"],
        namespace=cfg["namespace"],
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    engines = dict(cfg["engines"])
    registry = connect(
        engines=list(engines),
        capacity=2,
        prefix=cfg["prefix"],
        journal_path=cfg["journal"],
        name=cfg["registry_name"],
        namespace=cfg["namespace"],
    )
    settings = load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}" for name, url in engines.items()],
        capacity=2,
        base_model_name=cfg["base_model"],
        lora_name_prefix=cfg["prefix"],
        owner_id=cfg["owner"],
        lease_ttl=cfg["lease_ttl"],
        request_timeout=120.0,
    )
    versioning = Versioning.from_settings(settings, registry=registry)
    incarnation = uuid.uuid4().hex[:6]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    out = _open_events(cfg["events"])
    try:
        load = AgentLoad(
            VersioningSource(versioning),
            agents=int(cfg["agents"]),
            prefix=f"{cfg['owner']}.{incarnation}",
            config=load_config(max_retries=20),
        )
        load.on_attempt.append(
            lambda a: _write(
                out,
                {
                    "kind": "attempt",
                    "session_id": a.session_id,
                    "rid": a.rid,
                    "outcome": a.outcome.value,
                    "error_code": a.error_code,
                    "engine": a.engine,
                    "lora_name": a.lora_name,
                    "start": a.started_at,
                    "end": a.started_at + a.latency_s,
                },
            )
        )
        keeper = versioning.lease
        if keeper is not None:
            keeper.listeners.append(
                lambda e: _write(
                    out,
                    {
                        "kind": "lease",
                        "event": e.kind.value,
                        "lease_id": e.lease_id,
                        "incarnation": incarnation,
                        "released": len(e.released),
                        "reason": e.reason,
                        "at": time.monotonic(),
                    },
                )
            )
        load.start()
        _write(out, {"kind": "started", "incarnation": incarnation, "pid": os.getpid()})
        await stop.wait()
        await load.stop()
        await versioning.aclose()
        _write(out, {"kind": "stopped", "incarnation": incarnation, "errors": load.errors})
    finally:
        out.close()
    ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg = json.loads(Path(args[0]).read_text())
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(run(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
