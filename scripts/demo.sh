#!/usr/bin/env bash
# The main job (`make demo`): build what the demo needs, then run it on two real SGLang engines.
#   1. the dev venv (.venv), 2. the SGLang engine venv (outside the clone, created on first use:
#   several minutes), 3. the tiny model fixture with adapters A, B and C (cached after the first
#   build), 4. examples/demo.py, which starts E0 and E1, runs the scenario, prints the report and
#   always stops the engines. Exit status: the demo's (0 = every check passed).
# Extra arguments go to examples/demo.py (see `--help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
SECONDS=0
setup_log=$(mktemp)
fixture_json=$(mktemp)
trap 'rm -f "$setup_log" "$fixture_json"' EXIT
echo "== dev venv"
bash scripts/dev-env.sh >"$setup_log" 2>&1 || { cat "$setup_log"; exit 1; }
echo "== SGLang engine venv (created on first use; several minutes)"
bash scripts/engine-env.sh >"$setup_log" 2>&1 || { cat "$setup_log"; exit 1; }
echo "== model fixture"
.venv/bin/python -m agentic_lora_harness.fixture >"$fixture_json" 2>"$setup_log" || { cat "$setup_log"; exit 1; }
echo "== setup took ${SECONDS} s; running the demo"
status=0
PYTHONPATH="$root/examples/agents${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python examples/demo.py --fixture-json "$fixture_json" "$@" || status=$?
echo "== make demo wall time: ${SECONDS} s (exit status ${status})"
exit "$status"
