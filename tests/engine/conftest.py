"""Real-engine fixtures (SGLang venv, model fixture, two-engine fleet) for the tests in this folder.

The fixtures live in the harness package so other test folders can reuse them; tests that use the
fleet are marked ``pytest.mark.engine``. They never skip: a missing engine venv is an error.
"""

from __future__ import annotations

from agentic_lora_harness.pytest_fixtures import engine_env, engine_fleet, model_fixture

__all__ = ["engine_env", "engine_fleet", "model_fixture"]
