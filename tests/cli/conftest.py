"""Fixtures of the CLI tests."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest


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
