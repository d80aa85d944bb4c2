#!/usr/bin/env bash
# Line coverage of hyper_parallel_ms/ over the whole suite, rank processes included: every Python
# process of the run (pytest, the ranks of the test pools, scripts the tests start) measures itself
# through coverage.py's subprocess support, and the ranks write their data after each task.
# Usage: bash scripts/coverage.sh [pytest arguments]; prints the report, writes .coverage-data/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
PY="${HPMS_VENV:-$ROOT/.venv}/bin/python"
"$PY" -m pip install -q --disable-pip-version-check "coverage>=7"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import os; os.environ.get('COVERAGE_PROCESS_START') and __import__('coverage').process_startup()" \
  > "$SITE/hpms_coverage_startup.pth"
DATA="$ROOT/.coverage-data"
rm -rf "$DATA" && mkdir -p "$DATA"
RC="$DATA/coveragerc"
printf '[run]\nparallel = True\nsource = hyper_parallel_ms\ndata_file = %s/.coverage\n[report]\nprecision = 1\n' "$DATA" > "$RC"
cd "$ROOT"
status=0
COVERAGE_PROCESS_START="$RC" "$PY" -m pytest "$@" || status=$?
"$PY" -m coverage combine --rcfile="$RC" -q
"$PY" -m coverage report --rcfile="$RC" | tail -n 1
exit $status
