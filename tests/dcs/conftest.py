from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from agentic_lora_dcs import DcsBackend

from tests.dcs.util import BUCKET_BYTES, SIDECAR_TOKEN, EdgeTransport, SidecarProcess


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
