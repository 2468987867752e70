"""Shared fixtures for every test folder.

The real-engine fixtures (SGLang venv, tiny model fixture, two-engine fleet) are registered once
here: a fixture imported into several conftests would be one session fixture per conftest, and a
run that collects both tests/engine and tests/e2e would start two fleets.
"""

pytest_plugins = ["agentic_lora_harness.pytest_fixtures"]
