#!/usr/bin/env bash
# Creates (or finds) the SGLang engine venv used by the real-engine tests and prints it as JSON.
# The venv lives outside the clone, in ${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/sglang-<version>,
# so every clone and CI run on this machine reuses it. Idempotent: a stamp written only after a
# successful install and import check marks it done; an unfinished venv is rebuilt.
# The logic lives in harness/agentic_lora_harness/engine_env.py; this is the shell entry point.
set -euo pipefail
exec "$(dirname "$0")/harness-module.sh" engine_env "$@"
