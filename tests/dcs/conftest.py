from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.dcs.util import SidecarProcess


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
    async with httpx.AsyncClient(timeout=30.0) as client:
        yield client
