"""Shared fixtures for every test folder.

The real-engine fixtures (SGLang venv, tiny model fixture, two-engine fleet) are registered once
here: a fixture imported into several conftests would be one session fixture per conftest, and a
run that collects both tests/engine and tests/e2e would start two fleets.
"""

import os

# Nothing a test imports may reach a model hub: the Hugging Face libraries read these when they
# are imported, so they are set before any test module is. TRL warns (a UserWarning, an error
# here) that ``rollout_func`` is experimental; the TRL integration's tests use it on purpose.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

from hypothesis import HealthCheck  # noqa: E402
from hypothesis import settings  # noqa: E402

pytest_plugins = ["agentic_lora_harness.pytest_fixtures"]

# No per-example deadline: on a shared 2-core machine beside two engines an example's wall time
# says nothing about the code, and a deadline turns load into a failing test. Examples stay
# bounded by their own max_examples; the too_slow health check is load too.
settings.register_profile(
    "agentic-lora", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("agentic-lora")
