#!/usr/bin/env bash
# Creates (or refreshes) the development environment in .venv at the repository root.
# Idempotent: a stamp keyed by pyproject.toml's hash skips the install when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
stamp=.venv/.agentic-lora-stamp
want=$(sha256sum pyproject.toml | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$py" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch: ask for the CPU build explicitly; a bare `torch` requirement resolves to a multi-GB CUDA build.
# On these machines torch==2.13.0 resolves to a local CPU wheel.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "$want" > "$stamp"
