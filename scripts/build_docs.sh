#!/usr/bin/env bash
# Build the documentation (docs/, Markdown pages and the API reference from the docstrings) into
# docs/_build/html with Sphinx, warnings as errors. Needs the docs extra: pip install -e ".[docs]".
# Usage: bash scripts/build_docs.sh [OUT_DIR] [extra sphinx-build flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/_build/html}"
shift || true
PY="${HPMS_VENV:-$ROOT/.venv}/bin/python"
[ -x "$PY" ] || PY=python3
exec "$PY" -m sphinx -W --keep-going -b html "$ROOT/docs" "$OUT" "$@"
