"""Fixtures of the TRL integration's tests: a scripted fleet and a bridge on it.

Nothing here may reach a model hub: the Hugging Face libraries are put offline before any test
module imports them.
"""

from __future__ import annotations

import os

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"
# TRL warns once that rollout_func is experimental; the tests use it on purpose.
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from agentic_lora_trl import DeploymentThread  # noqa: E402

from agentic_lora.testing.fleet import ScriptedFleet  # noqa: E402
from tests.trl.support import TokenEngine  # noqa: E402
from tests.trl.support import bridge_on  # noqa: E402


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
