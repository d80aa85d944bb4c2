#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with MindSpore, numpy<2, pytest and this package.
# Usage: source-free; prints nothing on a warm rerun. HPMS_VENV overrides the location (.venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HPMS_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
STAMP="$VENV/.hpms-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ]; then
  echo "setup: installing mindspore, numpy<2, pytest and hyper_parallel_ms into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
  touch "$STAMP"
fi
