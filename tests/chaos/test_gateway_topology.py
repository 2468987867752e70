"""Chaos: the process that runs the gateway and holds the registry is killed -9 and started again.

Topology: gateway. ``agentic-lora serve`` runs as a child process with a journaled
LocalRegistry (it holds the registry, the publisher, the reclaimer, the resolver and the
gateway), in front of the session's shared two-engine fleet through one
:class:`~tests.chaos.support.EngineTap` per engine (the taps live in the test process, so they
outlive serve). Eight example agents run tool-using episodes as HTTP clients of the gateway
(``X-Agentic-Session``); a publication of A, B, C, ... goes through the admin route every few
seconds. After the kill, serve is started again on the same journal, port and adapter store.

In this topology the gateway and the registry host are the same process, so the two fault kinds
differ in *where* it dies:

* the gateway fault: at a seeded point in the agents' traffic (after the n-th answered
  generation), with Sessions between turns and requests in flight;
* the registry host fault: at a seeded point inside a publication (its first adapter load sent,
  its first engine's load answered, or every engine's), so the journal holds a publication that
  no process is finishing any more.

Verdicts (``FaultReport.problems``): no Session's requests reached two adapters, as the engines
received them (a running agent continues on its bound version or gets a typed refusal: a
request that starts after the kill fails only as refused, nothing sent, while serve is away, or
as SESSION_EXPIRED/SESSION_CLOSED; the four parked Sessions must be served again, on their
version, after serve is back and a new default is committed); every publication a caller saw
committed is still committed and slots in use are exactly the versions holding one; a
publication commits within lease TTL + 30 s of serve's return; once the load stops every retired
version is reclaimed and no publication is left pending (the one cut by the kill is resolved by
the restarted process).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.scenarios import serve_killed

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("during", "name"),
    [
        # The gateway fault: killed under agent traffic.
        pytest.param("traffic", "gateway", id="gateway-under-load"),
        # The registry host fault: killed inside a publication.
        pytest.param("publication", "registry-host", id="registry-host-inside-a-publication"),
    ],
)
async def test_serve_killed(
    during: str, name: str, chaos_fleet: EngineFleet, tmp_path: Path, rng: random.Random
) -> None:
    report = await serve_killed(chaos_fleet, tmp_path, rng, during=during, name=name)
    print(report.summary(), f"\n  report: {report.write(tmp_path / 'report.json')}")
    assert report.problems == []
