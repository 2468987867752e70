#!/usr/bin/env bash
# Runs one module of the test harness (harness/agentic_lora_harness/<module>.py) with the clone's
# dev venv if it exists, else ${PYTHON:-python3}: scripts/engine-env.sh and scripts/vllm-env.sh are
# thin entry points onto it. Usage: scripts/harness-module.sh <module> [args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
module=$1
shift
if [[ -x $root/.venv/bin/python ]]; then
  py=$root/.venv/bin/python
else
  py=${PYTHON:-python3}
fi
# The harness's venv builders need only the standard library, so they also run before the dev
# venv exists.
PYTHONPATH="$root/harness${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m "agentic_lora_harness.$module" "$@"
