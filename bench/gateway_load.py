"""Gateway under hostile load: hundreds of concurrent clients, mixed valid and invalid traffic.

The gateway (``agentic-lora``'s FastAPI app under uvicorn, its own process, loopback) serves one
instant engine (``bench/instant_engine.py``, answers ``/generate`` at once) with one version
committed by registry verbs. ``--clients`` asyncio clients each loop for ``--seconds``: a valid
client runs Sessions of ``--turns`` generations and closes them with their own credential; a
hostile client sends, in rotation, oversized bodies (64 KiB over the limit), 100,000-deep JSON,
``n=10**9``, ``max_tokens=10**12``, nested content lists, broken JSON, a conflicting Session
header, and closes of other clients' Sessions without credentials, each with a fresh Session id.

It stops by itself after ``--seconds`` and prints: requests per kind, 5xx answers to invalid
input (required: 0), valid generations answered / sent (required: all), the Sessions still open
in the gateway and in the registry after the run (required: 0: every valid client closed its
Sessions, and no refused request opened one), and the gateway process's RSS every ``--sample``
seconds (flat after warm-up).

Usage: python bench/gateway_load.py [--clients 300] [--hostile 0.5] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import InstantEngine
from common import free_port
from common import machine
from common import terminate
from common import write_result

BODY_LIMIT = 1024 * 1024  # the gateway's body limit in this run (1 MiB)


def _serve(engine_url: str, port: int) -> None:
    """Child process: the gateway on 127.0.0.1:port in front of the instant engine."""
    import logging

    import uvicorn
    from common import publish_in_registry

    from agentic_lora.config import load_settings
    from agentic_lora.gateway.app import Gateway

    logging.basicConfig(level=logging.ERROR)

    async def main() -> None:
        settings = load_settings(
            enable_versioned_lora_publication=True,
            engines=[f"e0={engine_url}"],
            base_model_name="bench-model",
            engine_max_loaded_loras=8,
            engine_max_loras_per_batch=8,
            gateway_max_body_bytes=BODY_LIMIT,
            gateway_max_sessions=4096,
        )
        from agentic_lora_http.backend import HttpPushBackend

        from agentic_lora.engines.backends import EngineRef

        class _InstantBackend(HttpPushBackend):
            # The instant engine reports no incarnation; it is the one the version was
            # committed under, so the repairer sees no restart and keeps the engine healthy.
            async def incarnation(self, engine: EngineRef) -> str:
                return "bench"

        store = tempfile.mkdtemp(prefix="gateway-load-")
        gateway = await Gateway.from_settings(settings, backend=_InstantBackend(store_root=store))
        async with gateway:
            await publish_in_registry(gateway.deployment.registry, "e0")
            config = uvicorn.Config(
                gateway.app, host="127.0.0.1", port=port, log_config=None, access_log=False
            )
            await uvicorn.Server(config).serve()

    asyncio.run(main())


def _hostile_requests(n: int) -> tuple[str, str, dict[str, str], bytes]:
    """The n-th hostile request: (kind, path, headers, body)."""
    sid = {"authorization": f"Bearer hostile-{os.getpid()}-{n}"}
    chat = "/v1/chat/completions"
    kinds: list[tuple[str, str, dict[str, str], bytes]] = [
        ("oversized", "/generate", sid, b" " * (BODY_LIMIT + 65536)),
        ("deep_json", chat, sid, b"[" * 100_000 + b"]" * 100_000),
        (
            "huge_n",
            "/generate",
            sid,
            json.dumps({"text": "x", "sampling_params": {"n": 10**9}}).encode(),
        ),
        (
            "huge_max_tokens",
            chat,
            sid,
            json.dumps(
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}
            ).encode(),
        ),
        (
            "nested_content",
            chat,
            sid,
            json.dumps({"messages": [{"role": "user", "content": [[["x"]]]}]}).encode(),
        ),
        ("broken_json", "/generate", sid, b'{"text": '),
        (
            "conflicting_headers",
            "/generate",
            {**sid, "x-agentic-session": f"other-{n}"},
            json.dumps({"text": "x"}).encode(),
        ),
        ("foreign_close", f"/v1/sessions/valid-{n % 50}-0/close", {}, b""),
    ]
    return kinds[n % len(kinds)]


async def _valid_client(
    http: httpx.AsyncClient, index: int, turns: int, stop: float, stats: Counter[str]
) -> None:
    round_ = 0
    while time.monotonic() < stop:
        headers = {"authorization": f"Bearer valid-{index}-{round_}"}
        for turn in range(turns):
            body = {"text": f"turn {turn}", "sampling_params": {"max_new_tokens": 4}}
            stats["valid_sent"] += 1
            try:
                response = await http.post("/generate", json=body, headers=headers)
            except httpx.HTTPError:
                stats["valid_transport_error"] += 1
                continue
            if response.status_code == 200:
                stats["valid_ok"] += 1
            else:
                code = response.json().get("error", {}).get("code", "?")
                stats[f"valid_{response.status_code}_{code}"] += 1
        with contextlib.suppress(httpx.HTTPError):
            await http.post("/v1/sessions/close", headers=headers)
        round_ += 1


async def _hostile_client(
    http: httpx.AsyncClient, index: int, stop: float, stats: Counter[str], kinds: Counter[str]
) -> None:
    n = index
    while time.monotonic() < stop:
        kind, path, headers, body = _hostile_requests(n)
        n += 997  # a prime step: every client walks through every kind
        kinds[kind] += 1
        stats["invalid_sent"] += 1
        try:
            response = await http.post(
                path, content=body, headers={**headers, "content-type": "application/json"}
            )
        except httpx.HTTPError:
            stats["invalid_transport_error"] += 1  # the server may close an oversized upload
            continue
        if response.status_code >= 500:
            stats["invalid_5xx"] += 1
        elif response.status_code < 400:
            stats[f"invalid_answered_{response.status_code}"] += 1


async def _drive(args: argparse.Namespace, base_url: str, pid: int) -> dict[str, Any]:
    stats: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    process = psutil.Process(pid)
    rss: list[tuple[float, float]] = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=60.0, limits=limits, trust_env=False
    ) as http:
        start = time.monotonic()
        stop = start + args.seconds
        hostile = int(args.clients * args.hostile)
        tasks = [
            asyncio.create_task(_hostile_client(http, i, stop, stats, kinds))
            for i in range(hostile)
        ] + [
            asyncio.create_task(_valid_client(http, i, args.turns, stop, stats))
            for i in range(args.clients - hostile)
        ]
        while not all(t.done() for t in tasks):
            rss.append((round(time.monotonic() - start, 1), process.memory_info().rss / 2**20))
            await asyncio.wait(tasks, timeout=args.sample)
        for task in tasks:
            task.result()
        rss.append((round(time.monotonic() - start, 1), process.memory_info().rss / 2**20))
        elapsed = time.monotonic() - start
        metrics_live = None
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = await http.get("/health/live")
            metrics_live = health.status_code
        open_after = await _open_sessions(http)
    return {
        "elapsed_s": round(elapsed, 1),
        "stats": dict(stats),
        "kinds": dict(kinds),
        "rss_mb": [(t, round(m, 1)) for t, m in rss],
        "health_after": metrics_live,
        "open_sessions_after": open_after,
    }


async def _open_sessions(http: httpx.AsyncClient) -> dict[str, float]:
    """The gateway's and the registry's open Sessions, from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("agentic_lora_sessions_live", "agentic_lora_registry_sessions")
    text = (await http.get("/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--hostile", type=float, default=0.5, help="share of hostile clients")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sample", type=float, default=5.0, help="RSS sample interval (s)")
    parser.add_argument("--serve", nargs=2, metavar=("ENGINE_URL", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]))
        return
    port = free_port()
    with InstantEngine() as engine:
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--serve", engine.base_url, str(port)],
            stdin=subprocess.DEVNULL,
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            with httpx.Client(trust_env=False, timeout=2.0) as probe:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if probe.get(f"{base_url}/health/live").status_code == 200:
                            break
                    if child.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the gateway did not start")
                    time.sleep(0.1)
            result = asyncio.run(_drive(args, base_url, child.pid))
        finally:
            terminate(child, grace=30)
    s = result["stats"]
    warm = [m for t, m in result["rss_mb"] if t >= min(10.0, args.seconds / 3)]
    print(f"clients {args.clients} ({args.hostile:.0%} hostile), {result['elapsed_s']} s")
    print(f"invalid requests sent: {s.get('invalid_sent', 0)}  by kind: {result['kinds']}")
    print(f"5xx answers to invalid input: {s.get('invalid_5xx', 0)}")
    print(
        f"invalid requests answered 2xx: {sum(v for k, v in s.items() if k.startswith('invalid_answered'))}"
    )
    print(f"connection closed on invalid upload: {s.get('invalid_transport_error', 0)}")
    print(f"valid generations answered: {s.get('valid_ok', 0)} / {s.get('valid_sent', 0)}")
    others = {
        k: v for k, v in s.items() if k.startswith("valid_") and k not in ("valid_ok", "valid_sent")
    }
    print(f"valid generations not answered 200: {others or 0}")
    print(f"RSS (MiB) over time: {result['rss_mb']}")
    if warm:
        print(f"RSS after warm-up: min {min(warm):.1f}, max {max(warm):.1f} MiB")
    print(f"Sessions open after the run: {result['open_sessions_after']}")
    print(f"/health/live after the run: {result['health_after']}")
    write_result("gateway_load", {"args": vars(args), "machine": machine(), **result})


if __name__ == "__main__":
    main()
