"""Test-harness compatibility shim, CPU only: loaded by Python at start-up of an engine process.

Only the test harness puts this directory on ``PYTHONPATH`` (and sets ``AGENTIC_LORA_CPU_SHIM=1``),
and only when the engine venv has no CUDA device. See ``agentic_lora_cpu_shim`` for what it does.
"""

from __future__ import annotations

import importlib
import os

if os.environ.get("AGENTIC_LORA_CPU_SHIM") == "1":
    importlib.import_module("agentic_lora_cpu_shim").install()
