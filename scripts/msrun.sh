#!/usr/bin/env bash
# The project's virtualenv's msrun, with that virtualenv's bin first on PATH and this checkout on
# PYTHONPATH: msrun starts each worker as `python <script>`, found through PATH, so the venv's
# msrun run from a shell without the venv active starts workers of another Python (one without
# MindSpore: "No module named 'mindspore'").
# Usage: bash scripts/msrun.sh --worker_num=2 --local_worker_num=2 --join=True my_script.py [args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
VENV="${HPMS_VENV:-$ROOT/.venv}"
export PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/msrun" "$@"
