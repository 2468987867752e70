"""Fixtures of the TRL integration's tests: a scripted fleet and a bridge on it.

(The root conftest puts the Hugging Face libraries offline before any test module imports them.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agentic_lora_trl import DeploymentThread

from agentic_lora.testing.fleet import ScriptedFleet
from tests.trl.support import TokenEngine
from tests.trl.support import bridge_on


@pytest.fixture
def fleet() -> Iterator[ScriptedFleet]:
    """Two scripted SGLang engines answering generations on token ids, with logprobs."""
    with ScriptedFleet(engine_type=TokenEngine) as scripted:
        yield scripted


@pytest.fixture
def bridge(fleet: ScriptedFleet, tmp_path: Path) -> Iterator[DeploymentThread]:
    """A started DeploymentThread on the scripted fleet (capacity 2); closed after the test."""
    thread = bridge_on(fleet, tmp_path / "store")
    try:
        yield thread
    finally:
        thread.close()
