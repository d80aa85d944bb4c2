#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with MindSpore, numpy<2, pytest and this package.
# Usage: source-free; prints nothing on a warm rerun. HPMS_VENV overrides the location (.venv).
# CI tests one MindSpore release, pinned here (HPMS_MINDSPORE overrides it); the package supports
# 2.8 to 2.10, which scripts/test_versions.sh tests in venvs of their own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HPMS_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
MINDSPORE="${HPMS_MINDSPORE:-2.10.0}"
STAMP="$VENV/.hpms-installed-$MINDSPORE"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ]; then
  echo "setup: installing mindspore==$MINDSPORE, numpy<2, pytest and hyper_parallel_ms into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "mindspore==$MINDSPORE" -e "$ROOT[test]"
  touch "$STAMP"
fi
# MindFormers' PyNative stack for tests/test_mindformers.py (test environment only; --no-deps: see the file).
# HPMS_MINDFORMERS=0 skips it (those tests then skip, saying why).
MF_REQS="$ROOT/scripts/requirements-mindformers.txt"
MF_STAMP="$VENV/.hpms-mindformers-installed"
if [ "${HPMS_MINDFORMERS:-1}" != "0" ] && { [ ! -f "$MF_STAMP" ] || [ "$MF_REQS" -nt "$MF_STAMP" ]; }; then
  echo "setup: installing MindFormers 2.1.0's PyNative test dependencies (--no-deps) into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$MF_REQS"
  touch "$MF_STAMP"
fi
