"""What one update of the status page costs with a big fleet history and many Sessions.

Builds a real in-memory registry holding ``--versions`` versions (all but the last two
reclaimed, one RETIRED, one PUBLISHED as the default) and ``--sessions`` Sessions bound to the
two live versions under ``--leases`` owner leases, fills the page's records (a full ring of
publications, refusals) and measures, side by side in one run:

* bytes of one page update (``/ui/api/view``, first page, the page's default query) and of the
  ``/admin/status`` answer for the same state (every version and lease listed);
* server time to build one update: the registry status read, the view model, the JSON encoding
  (median and p95 of ``--repeats`` builds, interleaved with the admin form's so a drift of the
  shared machine hits both alike).

An unchanged state answers ``304`` with no body, so a page left open costs these bytes only
when something changed.

Usage: python bench/status_page.py [--versions 500] [--sessions 10000] [--leases 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from common import machine
from common import print_table
from common import summarize
from common import write_result

from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import TooManySessionsError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.gateway.ui.activity import OperationLog
from agentic_lora.gateway.ui.activity import RefusalLog
from agentic_lora.gateway.ui.view import GatewayFacts
from agentic_lora.gateway.ui.view import ViewQuery
from agentic_lora.gateway.ui.view import build_view
from agentic_lora.gateway.ui.view import lag_histogram
from agentic_lora.gateway.wire import status_json
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.publish import publish_by_verbs

ENGINES = ("e0", "e1", "e2", "e3")


async def fleet_registry(versions: int, sessions: int, leases: int) -> LocalRegistry:
    registry = LocalRegistry(engines=ENGINES, capacity=2, sweep_interval=None)
    for n in range(versions):
        await publish_by_verbs(registry, f"step-{n:05d}", ENGINES, incarnation="i")
        if n >= 1 and n < versions - 1:
            # The previous version retired with no Session left: reclaim it.
            old = f"step-{n - 1:05d}"
            claim = await registry.claim_reclaim(request_id=new_request_id(), version_id=old)
            for engine in ENGINES:
                await registry.confirm_reclaim(
                    request_id=new_request_id(),
                    version_id=old,
                    reclaim_id=claim.reclaim_id,
                    engine=engine,
                )
        if n == versions - 2:
            await bind(registry, sessions // 2, leases, "old")
    await bind(registry, sessions - sessions // 2, leases, "new")
    return registry


async def bind(registry: LocalRegistry, sessions: int, leases: int, tag: str) -> None:
    grants = [
        await registry.open_lease(
            request_id=new_request_id(), owner=f"worker-{i:04d}", incarnation="i", ttl=60.0
        )
        for i in range(leases)
    ]
    for n in range(sessions):
        await registry.bind_first(
            request_id=new_request_id(),
            session_key=f"{tag}-{n}",
            lease=grants[n % leases].lease_id,
        )


def full_records() -> tuple[OperationLog, RefusalLog]:
    operations, refusals = OperationLog(), RefusalLog()
    for n in range(40):  # more than the log keeps
        version = f"step-{n:05d}"
        steps = [(None, Phase.RESERVE)]
        for engine in ENGINES:
            steps += [
                (engine, Phase.OBSERVE),
                (engine, Phase.PREPARE),
                (engine, Phase.RECORD_READY),
            ]
        steps += [(engine, Phase.OBSERVE) for engine in ENGINES] + [(None, Phase.COMMIT)]
        for engine, phase in steps:
            operations(PhaseEvent(engine, phase, PhaseStatus.STARTED, version_id=version))
            operations(PhaseEvent(engine, phase, PhaseStatus.DONE, 0.0123, version_id=version))
    for n in range(100):
        error = TooManySessionsError("full") if n % 3 else InvalidRequestError("bad")
        refusals.record(error, DispatchOutcome.REFUSED, "/v1/chat/completions")
    return operations, refusals


def view_bytes(
    status: RegistryStatus, operations: OperationLog, refusals: RefusalLog, query: ViewQuery
) -> bytes:
    facts = GatewayFacts(
        sessions=2048, adopted=0, engine_health=dict.fromkeys(ENGINES, True), ready=True
    )
    lag = lag_histogram(
        [("x_bucket", {"le": le}, 10.0) for le in ("0.0", "1.0", "2.0", "+Inf")]
        + [("x_count", {}, 10.0), ("x_sum", {}, 4.0)]
    )
    view = build_view(
        status,
        facts,
        operations=operations.recent(),
        refusals=refusals,
        dispatch_lag=lag,
        query=query,
        now=time.time(),
    )
    return json.dumps(view, separators=(",", ":")).encode()


def admin_bytes(status: RegistryStatus) -> bytes:
    return json.dumps({"registry": status_json(status)}, separators=(",", ":")).encode()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--versions", type=int, default=500)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--leases", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    registry = await fleet_registry(args.versions, args.sessions, args.leases)
    operations, refusals = full_records()
    default, everything = ViewQuery(), ViewQuery(all_versions=True, versions_limit=200)

    builders: dict[str, Callable[[RegistryStatus], bytes]] = {
        "view (default page)": lambda st: view_bytes(st, operations, refusals, default),
        "view (200 versions)": lambda st: view_bytes(st, operations, refusals, everything),
        "admin status": admin_bytes,
    }
    timings: dict[str, list[float]] = {"status read": [], **{name: [] for name in builders}}
    sizes: dict[str, int] = {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        status = await registry.status()
        timings["status read"].append(time.perf_counter() - start)
        for name, build in builders.items():
            start = time.perf_counter()
            body = build(status)
            timings[name].append(time.perf_counter() - start)
            sizes[name] = len(body)
    assert status.live_sessions == args.sessions
    assert len(status.versions) == args.versions
    await registry.aclose()

    rows: list[list[object]] = []
    result: dict[str, Any] = {"machine": machine(), "args": vars(args), "results": {}}
    for name, samples in timings.items():
        summary = summarize(samples)
        size = sizes.get(name)
        rows.append(
            [
                name,
                size if size is not None else "-",
                f"{summary.p50 * 1e3:.2f}",
                f"{summary.p95 * 1e3:.2f}",
            ]
        )
        result["results"][name] = {"bytes": size, "p50_s": summary.p50, "p95_s": summary.p95}
    ratio = sizes["admin status"] / sizes["view (default page)"]
    result["results"]["admin_to_view_bytes"] = ratio
    print(
        f"{args.versions} versions, {args.sessions} Sessions, {args.leases} leases, "
        f"{len(ENGINES)} engines; {args.repeats} builds each"
    )
    print_table(["what", "bytes", "p50 ms", "p95 ms"], rows)
    print(f"/admin/status is {ratio:.1f}x the bytes of one page update")
    write_result("status_page", result)


if __name__ == "__main__":
    asyncio.run(main())
