#!/usr/bin/env bash
# The project's whole check, as CI runs it: lint, types, tests (with coverage of agentic_lora/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
V=.venv/bin
echo "== ruff"; $V/ruff check . && $V/ruff format --check .
echo "== mypy --strict"; $V/mypy
echo "== mkdocs build --strict"; NO_MKDOCS_2_WARNING=1 $V/mkdocs build --strict -q -d "$(mktemp -d)"
echo "== pytest"
$V/python -m pytest --cov=agentic_lora --cov-report=term --cov-fail-under=${COV_MIN:-95} "$@"
