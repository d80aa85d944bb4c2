#!/usr/bin/env bash
# Set up the virtualenv (first run only) and run the whole test suite on CPU ranks.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k mesh`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${HPMS_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"
