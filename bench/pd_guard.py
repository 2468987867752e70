"""Dispatch-guard cost of PD groups: the plain guard vs the PD guard on one fleet.

Every versioned dispatch asks the dispatch guard which fleet members may get it. With PD groups
the registry's holders (role servers) are folded into members (groups whose every role server
holds the version) by :class:`agentic_lora.session.pd_guard.PDGuard`. This measures that fold per dispatch,
against the plain :class:`agentic_lora.session.middleware.PeekGuard` it wraps, in one process,
interleaved block by block (ABBA order) so a noisy neighbour hits both alike:

* ``all hold``: every server holds the version (the steady state: one tuple comparison);
* ``one lacks``: one decode server restarted and lacks it (the group is filtered out).

The fleet is one plain engine and ``--groups`` PD groups of one prefill and two decode servers.
No I/O: the registry read is a fixed in-memory status. Prints ns per check and the ratio.

Usage: python bench/pd_guard.py [--groups 4] [--blocks 20] [--checks 20000]
"""

from __future__ import annotations

import argparse
import time

from common import interleaved_order
from common import machine
from common import print_table
from common import summarize
from common import write_result

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.pd import PDFleet
from agentic_lora.engines.pd import PDGroup
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session.middleware import DispatchGuard
from agentic_lora.session.middleware import PeekGuard
from agentic_lora.session.pd_guard import PDGuard


def _fleet(groups: int) -> PDFleet:
    return PDFleet(
        (EngineRef("e0", "http://10.0.0.1:30000"),),
        tuple(
            PDGroup(
                f"g{i}",
                f"http://10.0.1.{i}:30000",
                (f"http://10.0.2.{i}:30000", f"http://10.0.3.{i}:30000"),
                f"http://10.0.1.{i}:8000",
            )
            for i in range(groups)
        ),
    )


def _per_check_ns(guard: DispatchGuard, binding: Binding, checks: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(checks):
        guard.check(binding)
    return (time.perf_counter_ns() - start) / checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--checks", type=int, default=20000)
    args = parser.parse_args()
    fleet = _fleet(args.groups)
    servers = tuple(e.name for e in fleet.publication_engines)
    binding = Binding(
        "session", VersionRef("A", "digest", "policy_lora@0-A-0123456789abcdef", 1), 1
    )
    rows: list[list[object]] = []
    results: dict[str, dict[str, float]] = {}
    for case, holders in (("all hold", servers), ("one lacks", servers[:-1])):
        status = VersionStatus(
            "A", "digest", binding.lora_name, VersionState.PUBLISHED, 1, 1, holders
        )
        plain = PeekGuard(lambda _version, status=status: status)
        guards: dict[str, DispatchGuard] = {"plain": plain, "pd": PDGuard(plain, fleet)}
        samples: dict[str, list[float]] = {name: [] for name in guards}
        for name in interleaved_order(list(guards), args.blocks):
            samples[name].append(_per_check_ns(guards[name], binding, args.checks))
        p50 = {name: summarize(values).p50 for name, values in samples.items()}
        results[case] = {**p50, "ratio": p50["pd"] / p50["plain"]}
        rows.append(
            [case, f"{p50['plain']:.0f}", f"{p50['pd']:.0f}", f"{p50['pd'] / p50['plain']:.2f}"]
        )
    print(f"fleet: 1 plain engine + {args.groups} PD groups (1 prefill, 2 decode each)")
    print_table(["case", "plain ns/check", "pd ns/check", "pd/plain"], rows)
    write_result("pd_guard", {"machine": machine(), "groups": args.groups, "results": results})


if __name__ == "__main__":
    main()
