from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from agentic_lora_dcs import DcsBackend
from agentic_lora_dcs.client import SidecarClient
from agentic_lora_dcs.plan import BucketPlan
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import PROTOCOL_VERSION
from agentic_lora_dcs.protocol import BeginRequest

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.foundation.identity import thaw_json
from agentic_lora.registry.types import ReadyReceipt
from tests.dcs.util import BUCKET_BYTES
from tests.dcs.util import SIDECAR_TOKEN
from tests.dcs.util import EdgeTransport
from tests.dcs.util import SidecarProcess
from tests.dcs.util import make_snapshot
from tests.dcs.util import resend
from tests.dcs.util import state_of
from tests.dcs.util import target_for


@pytest.fixture(scope="session")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SidecarProcess]]:
    """Two real sidecar processes (E0, E1), shared by the suite; tests use distinct names."""
    root = tmp_path_factory.mktemp("dcs-stores")
    started: dict[str, SidecarProcess] = {}
    try:
        for name in ("E0", "E1"):
            started[name] = SidecarProcess.start(name, Path(root / name))
        yield started
    finally:
        for process in started.values():
            process.stop()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    # Test requests that talk to sidecars directly carry the control token, as the backend does.
    async with httpx.AsyncClient(
        timeout=30.0, headers={"authorization": f"Bearer {SIDECAR_TOKEN}"}
    ) as client:
        yield client


class Publisher:
    """A DcsBackend whose HTTP client runs over a scripted :class:`EdgeTransport`."""

    def __init__(self, sidecars: dict[str, SidecarProcess], bucket_bytes: int) -> None:
        self.edge = EdgeTransport()
        self.client = httpx.AsyncClient(transport=self.edge, timeout=30.0)
        self.backend = DcsBackend(
            {n: s.url for n, s in sidecars.items()},
            bucket_bytes=bucket_bytes,
            collective_backend="gloo",
            client=self.client,
            sidecar_token=SIDECAR_TOKEN,
        )

    async def prepare(self, case: Case) -> ReadyReceipt:
        return await self.backend.prepare(case.sidecar.engine, case.target, case.snapshot)

    async def prepare_fails(
        self, case: Case, error: type[AgenticLoRAError], reason: str
    ) -> Mapping[str, Any]:
        """Prepare ``case`` expecting ``error`` for ``reason``; the error's details."""
        with pytest.raises(error) as failed:
            await self.prepare(case)
        assert failed.value.details["reason"] == reason
        return failed.value.details

    async def cleanup(self, case: Case) -> None:
        await self.backend.cleanup(case.sidecar.engine, case.target)

    async def reclaim(self, case: Case, reclaim_id: str) -> None:
        await self.backend.reclaim(case.sidecar.engine, lora_name=case.name, reclaim_id=reclaim_id)

    async def aclose(self) -> None:
        await self.backend.aclose()
        await self.client.aclose()
        await self.edge.aclose()


@pytest_asyncio.fixture
async def publisher(sidecars: dict[str, SidecarProcess]) -> AsyncIterator[Publisher]:
    pub = Publisher(sidecars, BUCKET_BYTES)
    try:
        yield pub
    finally:
        await pub.aclose()


@dataclass(frozen=True)
class Case:
    """One test's adapter version on one sidecar: the seeded snapshot, its target, and reads of
    the sidecar's and its engine's view of that name through the test's control client."""

    sidecar: SidecarProcess
    http: httpx.AsyncClient
    snapshot: AdapterSnapshot
    target: PublicationTarget
    #: How many buckets, so collectives, one transfer of the snapshot takes.
    buckets: int

    @property
    def name(self) -> str:
        """The lora name the engine serves the version under (the same for every attempt)."""
        return self.target.lora_name

    def attempt(self, attempt: int) -> Case:
        """The same version's attempt ``attempt`` (same lora name, new attempt number)."""
        return replace(self, target=replace(self.target, attempt=attempt))

    def stored(self) -> bool:
        """Whether the sidecar's store holds an adapter directory for the name."""
        return (self.sidecar.store_dir / self.name).exists()

    async def engine_state(self) -> dict[str, Any]:
        return await self.sidecar.engine_state(self.http)

    async def served(self) -> str | None:
        """The digest the engine serves under the name (None: it does not serve the name)."""
        return (await self.engine_state())["adapters"].get(self.name)  # type: ignore[no-any-return]

    async def loads(self) -> int:
        """Physical loads of the name the engine did (0: never loaded)."""
        return int((await self.engine_state())["physical_loads"].get(self.name, 0))

    async def unloads(self) -> int:
        """Physical unloads of the name the engine did (0: never unloaded)."""
        return int((await self.engine_state())["physical_unloads"].get(self.name, 0))

    async def named_calls(self, op: str) -> int:
        """``op`` calls the engine received that named the name (repeats included)."""
        calls = (await self.engine_state())["calls"]
        return sum(1 for called, body in calls if called == op and body["lora_name"] == self.name)

    async def view(self, attempt: int = 1) -> dict[str, Any] | None:
        return await self.sidecar.attempt(self.http, self.name, attempt)

    async def state(self, attempt: int = 1) -> str | None:
        return await state_of(self.sidecar, self.http, self.name, attempt)

    async def reclaimed(self) -> bool:
        """Whether the sidecar lists the name as reclaimed (fenced for good)."""
        return self.name in (await self.sidecar.status(self.http))["reclaimed"]

    async def collectives(self, attempt: int = 1) -> int:
        """Collectives the sidecar entered for the attempt (it must have a record of it)."""
        view = await self.view(attempt)
        assert view is not None
        return int(view["collectives"])

    async def stash_bytes(self) -> int:
        """Bytes the sidecar holds in stashes, over all its attempts."""
        return await self.sidecar.stash_bytes(self.http)

    async def script(self, op: str, *faults: str) -> None:
        await self.sidecar.script(self.http, op, *faults)

    async def restart_engine(self) -> None:
        await self.sidecar.restart_engine(self.http)

    async def calls(self, op: str) -> int:
        """How many ``op`` calls the sidecar's engine has received so far (any name)."""
        return sum(1 for called, _ in (await self.engine_state())["calls"] if called == op)

    async def gate(self, op: str, gate: str) -> None:
        """The engine's next ``op`` call waits until :meth:`open_gate` opens ``gate``."""
        await self._control("gate", {"op": op, "gate": gate})

    async def open_gate(self, gate: str) -> None:
        await self._control("open", {"gate": gate})

    async def wait_for_calls(self, op: str, count: int) -> None:
        """Return once the sidecar's engine has received ``count`` calls of ``op``."""
        await self._control("wait", {"op": op, "count": count})

    async def _control(self, verb: str, body: dict[str, Any]) -> None:
        url = f"{self.sidecar.url}/_test/engine/{verb}"
        (await self.http.post(url, json=body)).raise_for_status()

    async def resend(self, path: str, body: bytes) -> httpx.Response:
        return await resend(self.http, self.sidecar.url + path, body)

    def client(self) -> SidecarClient:
        """A protocol client of its own, for a sender the test scripts message by message."""
        return SidecarClient(
            self.sidecar.url,
            engine=self.sidecar.name,
            client=self.http,
            end_timeout=30.0,
            token=SIDECAR_TOKEN,
        )

    def begin(
        self, incarnation: str, plan: BucketPlan | None = None, *, version_id: str | None = None
    ) -> BeginRequest:
        """The attempt's Begin claiming the snapshot's digest and config (and its plan, unless
        ``plan`` is given)."""
        return BeginRequest(
            driver="d0d0d0d0",
            lora_name=self.name,
            attempt=self.target.attempt,
            version_id=version_id or self.target.version_id,
            digest=self.snapshot.digest,
            incarnation=incarnation,
            config=thaw_json(self.snapshot.config),
            plan=plan or plan_for_snapshot(self.snapshot, BUCKET_BYTES),
            backend="gloo",
            protocol=PROTOCOL_VERSION,
        )


class Cases:
    """Makes :class:`Case` s on the suite's sidecars (distinct seeds and version ids per test)."""

    def __init__(self, sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient) -> None:
        self._sidecars = sidecars
        self._http = http

    def __call__(self, sidecar: str, *, seed: int, version_id: str) -> Case:
        return self.on(self._sidecars[sidecar], seed=seed, version_id=version_id)

    def on(self, sidecar: SidecarProcess, *, seed: int, version_id: str) -> Case:
        snapshot = make_snapshot(seed)
        buckets = len(plan_for_snapshot(snapshot, BUCKET_BYTES).buckets)
        return Case(sidecar, self._http, snapshot, target_for(snapshot, version_id), buckets)


@pytest.fixture
def cases(sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient) -> Cases:
    return Cases(sidecars, http)
