#!/usr/bin/env bash
# The project's whole check, as CI runs it: lint, types, docs, then every test with coverage of
# agentic_lora/. Extra arguments run pytest with them instead of the two default passes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
bash scripts/browser-env.sh  # Chromium for the status page's browser test (tests/e2e)
V=.venv/bin
SECONDS=0
echo "== ruff"; $V/ruff check . && $V/ruff format --check .
echo "== mypy --strict"; $V/mypy
echo "== mkdocs build --strict"; NO_MKDOCS_2_WARNING=1 $V/mkdocs build --strict -q -d "$(mktemp -d)"
if (($#)); then
  exec $V/python -m pytest "$@"
fi
# Two passes, so the SGLang fleet (a session fixture) is gone before the vLLM engines start:
# both at once would not fit in this machine's memory next to each other's peaks.
echo "== pytest (unit, stateful, Ray, gloo, real SGLang engines)"
$V/python -m pytest --ignore=tests/vllm --cov=agentic_lora --cov-report=
echo "== pytest (real vLLM engines)"
$V/python -m pytest tests/vllm --cov=agentic_lora --cov-append --cov-report=term \
  --cov-fail-under="${COV_MIN:-95}"
echo "== make test wall time: ${SECONDS} s"
