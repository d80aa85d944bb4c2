#!/usr/bin/env bash
# Set up the virtualenv (first run only) and run the whole test suite on CPU ranks.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k mesh`.
# The test files run on HPMS_TEST_WORKERS pytest workers (default 2, each with its own rank pools;
# 0 runs them in this process): a rank test leaves about a third of 2 cores idle while its ranks
# wait for each other, which the other worker's tests use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${HPMS_VENV:-$ROOT/.venv}/bin/python" -m pytest -n "${HPMS_TEST_WORKERS:-2}" --dist loadfile "$@"
