"""Real-engine fixtures (SGLang venv, model fixture, two-engine fleet) for the tests in this folder.

The fixtures live in the harness package and are registered for every test folder by
``tests/conftest.py``; tests that use the fleet are marked ``pytest.mark.engine``. They never skip: a missing engine venv is an error.
"""

from __future__ import annotations

import pytest

# The first test to use these fixtures pays for creating the engine venv on a fresh machine
# (minutes) plus starting the fleet; the per-test timeout covers fixture set-up too.
_SETUP_HEAVY_FIXTURES = frozenset({"engine_env", "engine_fleet"})
_SETUP_HEAVY_TIMEOUT_SECONDS = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _SETUP_HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.timeout(_SETUP_HEAVY_TIMEOUT_SECONDS))
