"""Fixtures of the CLI tests."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.cli.support import Running
from tests.cli.support import running_server


@pytest.fixture
def root_logging() -> Iterator[None]:
    """``serve`` configures the root logger for its process; put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``AGENTIC_LORA_*`` variable of the machine running the tests leaks into a command."""
    for name in list(os.environ):
        if name.startswith("AGENTIC_LORA_"):
            monkeypatch.delenv(name)


@pytest_asyncio.fixture
async def srv(tmp_path: Path) -> AsyncIterator[Running]:
    """A served gateway whose background reclaimer and resolver are stopped, so every reclaim
    and resolve round is one a command runs (a background round would race the command for a
    version, and settle a BLOCKED publication on its own)."""
    async with running_server(tmp_path) as srv:
        await srv.served.gateway.deployment.reclaimer.stop()
        await srv.served.gateway.deployment.resolver.stop()
        yield srv
