"""Shared fixtures for every test folder.

The real-engine fixtures (SGLang venv, tiny model fixture, two-engine fleet) are registered once
here: a fixture imported into several conftests would be one session fixture per conftest, and a
run that collects both tests/engine and tests/e2e would start two fleets.
"""

from hypothesis import HealthCheck
from hypothesis import settings

pytest_plugins = ["agentic_lora_harness.pytest_fixtures"]

# No per-example deadline: on a shared 2-core machine beside two engines an example's wall time
# says nothing about the code, and a deadline turns load into a failing test. Examples stay
# bounded by their own max_examples; the too_slow health check is load too.
settings.register_profile(
    "agentic-lora", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("agentic-lora")
