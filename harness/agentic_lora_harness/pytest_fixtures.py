"""pytest fixtures for real-engine tests: the SGLang venv, the model fixture and an engine fleet.

Import them into a ``conftest.py`` (``from agentic_lora_harness.pytest_fixtures import
engine_env, engine_fleet, model_fixture``) or list this module in a root conftest's
``pytest_plugins``. The fleet starts once per test session, only when a test asks for it. If the
engine venv cannot be created the fixture errors rather than skips: CI must run these tests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import pytest

from agentic_lora_harness.engine_env import EngineEnv
from agentic_lora_harness.engine_env import ensure_engine_env
from agentic_lora_harness.engines import EngineFleet
from agentic_lora_harness.fixture import Fixture
from agentic_lora_harness.fixture import build_fixture
from agentic_lora_harness.venv_builder import BuiltVenv

__all__ = ["engine_env", "engine_fleet", "model_fixture", "write_fleet_report"]

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def engine_env() -> EngineEnv:
    """The SGLang engine venv, created on first use (several minutes, once per machine)."""
    return ensure_engine_env()


@pytest.fixture(scope="session")
def model_fixture() -> Fixture:
    """The tiny Qwen3 model and adapters A, B, C (built once, then cached)."""
    return build_fixture()


@pytest.fixture(scope="session")
def engine_fleet(engine_env: EngineEnv, model_fixture: Fixture) -> Iterator[EngineFleet]:
    """Two SGLang engines, E0 and E1, serving the fixture model for the whole session.

    On teardown, ``fleet-report.json`` (start-up seconds and memory per engine) is written next to
    the engine logs.
    """
    with EngineFleet(engine_env, model_fixture, count=2) as fleet:
        yield fleet
        write_fleet_report(fleet, "engine_env", engine_env, sglang=engine_env.sglang_version)


def write_fleet_report(
    fleet: EngineFleet, env_key: str, env: BuiltVenv, **versions: str
) -> dict[str, Any]:
    """Write ``fleet-report.json`` beside the engine logs: the venv (``env_key``: its engine
    ``versions``, torch, install seconds, size) and each engine's start-up seconds, incarnation
    and memory. Returns the report (it is also logged)."""
    report = {
        env_key: {
            **versions,
            "torch": env.torch_version,
            "install_seconds": env.install_seconds,
            "size_bytes": env.size_bytes,
        },
        "engines": {
            name: {
                "startup_seconds": fleet.startup_seconds(name),
                "incarnation": fleet.incarnation(name),
                **(asdict(fleet.memory(name)) if fleet.pid(name) else {}),
            }
            for name in fleet.names
        },
    }
    (fleet.log_dir / "fleet-report.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("engine fleet report", extra={"report": report})
    return report
