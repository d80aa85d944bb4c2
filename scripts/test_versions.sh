#!/usr/bin/env bash
# Run the tests on each supported MindSpore release, each in its own virtualenv.
#
# Usage: scripts/test_versions.sh [pytest args...]        (default: the whole suite)
#   HPMS_VERSIONS      releases to test (default: "2.8.0 2.9.0 2.10.0")
#   HPMS_VERSIONS_DIR  where the virtualenvs live (default: /tmp/hpms-versions); reused on reruns
# The package itself is taken from this checkout through PYTHONPATH (not installed).
# Prints one summary line per release and exits non-zero if any release failed.
# Example: scripts/test_versions.sh tests/test_dtensor.py -q
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${HPMS_VERSIONS_DIR:-/tmp/hpms-versions}"
VERSIONS="${HPMS_VERSIONS:-2.8.0 2.9.0 2.10.0}"
mkdir -p "$DIR"
declare -a SUMMARY=()
status=0
for version in $VERSIONS; do
  venv="$DIR/mindspore-$version"
  log="$DIR/mindspore-$version.log"
  if [ ! -f "$venv/.hpms-installed" ]; then
    echo "test_versions: installing mindspore==$version into $venv" >&2
    "${PYTHON:-python3}" -m venv "$venv" &&
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "mindspore==$version" "numpy<2" "pytest>=7" &&
      touch "$venv/.hpms-installed"
    if [ ! -f "$venv/.hpms-installed" ]; then
      SUMMARY+=("mindspore $version: INSTALL FAILED")
      status=1
      continue
    fi
  fi
  echo "test_versions: mindspore $version, log in $log" >&2
  (cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest "$@") >"$log" 2>&1
  rc=$?
  last="$(grep -E '(passed|failed|error|no tests ran)' "$log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')"
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("mindspore $version: OK   ($last)")
  else
    SUMMARY+=("mindspore $version: FAIL rc=$rc ($last)")
    status=1
  fi
done
echo "---- summary ----"
printf '%s\n' "${SUMMARY[@]}"
exit "$status"
