"""The DCS backend passes the backend conformance suite, over real gloo process groups.

The engines are scripted SGLang doubles living inside the suite's two real sidecar processes; the
suite steers them through the hosts' ``/_test`` routes, and every prepare moves its bytes through
a real two-rank gloo group. Each example starts from a fresh sidecar and engine in each process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import ClassVar

import httpx
import pytest
from agentic_lora_dcs import DcsBackend
from hypothesis import settings

from agentic_lora.engines.backends import EngineRef
from agentic_lora.testing.backend_conformance import BackendConformance
from agentic_lora.testing.backend_conformance import BackendHarness
from agentic_lora.testing.backend_conformance import Failure
from agentic_lora.testing.backend_conformance import Operation
from tests.dcs.util import SIDECAR_TOKEN
from tests.dcs.util import SidecarProcess

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(120)]

_ENGINE_OP = {
    Operation.PREPARE: "load",
    Operation.CLEANUP: "unload",
    Operation.RECLAIM: "unload",
}
_FAULT = {Failure.REFUSE: "refuse", Failure.LOSE_REPLY: "lose_reply"}


class SidecarEngineDouble:
    """One scripted engine behind a real sidecar, seen through the suite's EngineDouble."""

    def __init__(self, name: str, host: SidecarProcess, http: httpx.Client) -> None:
        self._name = name
        self._host = host
        self._http = http
        self._loads_at_boot: Counter[str] = Counter()
        self._unloads_at_boot: Counter[str] = Counter()

    @property
    def ref(self) -> EngineRef:
        return EngineRef(self._name, self._host.url)

    def _state(self) -> dict[str, dict[str, int | str]]:
        reply = self._http.get(f"{self._host.url}/_test/engine").raise_for_status()
        return reply.json()  # type: ignore[no-any-return]

    def held_digest(self, lora_name: str) -> str | None:
        digest = self._state()["adapters"].get(lora_name)
        return None if digest is None else str(digest)

    def loads(self, lora_name: str) -> int:
        return (
            int(self._state()["physical_loads"].get(lora_name, 0)) - self._loads_at_boot[lora_name]
        )

    def unloads(self, lora_name: str) -> int:
        done = int(self._state()["physical_unloads"].get(lora_name, 0))
        return done - self._unloads_at_boot[lora_name]

    def restart(self) -> None:
        state = self._http.post(f"{self._host.url}/_test/engine/restart").raise_for_status().json()
        self._loads_at_boot = Counter(state["physical_loads"])
        self._unloads_at_boot = Counter(state["physical_unloads"])

    def fail_next(self, operation: Operation, failure: Failure) -> None:
        body = {"op": _ENGINE_OP[operation], "faults": [_FAULT[failure]]}
        self._http.post(f"{self._host.url}/_test/engine/script", json=body).raise_for_status()

    def clear_failures(self) -> None:
        self._http.post(f"{self._host.url}/_test/engine/clear").raise_for_status()


class DcsHarness(BackendHarness):
    """A DcsBackend over two freshly reset sidecar hosts."""

    def __init__(self, hosts: dict[str, SidecarProcess]) -> None:
        self._http = httpx.Client(
            timeout=30.0, headers={"authorization": f"Bearer {SIDECAR_TOKEN}"}
        )
        for host in hosts.values():
            host.reset(self._http)
        backend = DcsBackend(
            {name: host.url for name, host in hosts.items()},
            bucket_bytes=32,  # the suite's tiny adapters still move in two buckets
            collective_backend="gloo",
            sidecar_token=SIDECAR_TOKEN,
        )
        super().__init__(
            backend, [SidecarEngineDouble(name, host, self._http) for name, host in hosts.items()]
        )

    async def release(self) -> None:
        self._http.close()


class DcsConformance(BackendConformance):
    #: Bound by the module's autouse fixture (the TestCase cannot take fixtures itself).
    hosts: ClassVar[dict[str, SidecarProcess]] = {}

    async def make_harness(self) -> DcsHarness:
        return DcsHarness(self.hosts)


@pytest.fixture(autouse=True)
def _bind_hosts(sidecars: dict[str, SidecarProcess]) -> Iterator[None]:
    # The suite's engines are e0/e1; the shared sidecar pair is reset before every example.
    DcsConformance.hosts = {"e0": sidecars["E0"], "e1": sidecars["E1"]}
    yield
    DcsConformance.hosts = {}


# No deadline and no too_slow check come from the suite's hypothesis profile (tests/conftest.py).
DcsConformance.TestCase.settings = settings(max_examples=10, stateful_step_count=12)
TestDcsConformance = DcsConformance.TestCase
