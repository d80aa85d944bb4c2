#!/usr/bin/env bash
# Main job: set up the virtualenv (first run only), launch the collective self-check on
# N ranks with msrun, and print rank 0's summary.
# Usage: bash scripts/run_selfcheck.sh [--nproc 4] [--device CPU|Ascend] [--port 8118]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPROC=4 DEVICE=CPU PORT=8118
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) NPROC="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    *) echo "unknown argument: $1 (expected --nproc N, --device CPU|Ascend, --port P)" >&2; exit 2 ;;
  esac
done
bash "$ROOT/scripts/setup_env.sh"     # first run: create the venv (progress shown here)
LOG_DIR="$ROOT/rank_logs/selfcheck"
rm -rf "$LOG_DIR"
export GLOG_v="${GLOG_v:-3}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
status=0
bash "$ROOT/scripts/msrun.sh" --worker_num="$NPROC" --local_worker_num="$NPROC" --master_port="$PORT" \
  --log_dir="$LOG_DIR" --join=True "$ROOT/scripts/comm_selfcheck.py" --device "$DEVICE" > "$LOG_DIR.msrun.log" 2>&1 || status=$?
for k in $(seq 0 $((NPROC - 1))); do
  grep -h "FAIL\|Error" "$LOG_DIR/worker_$k.log" 2>/dev/null | head -n 20 || true
done
grep -h "^selfcheck:" "$LOG_DIR"/worker_*.log || { echo "no summary: see $LOG_DIR and $LOG_DIR.msrun.log"; tail -n 30 "$LOG_DIR.msrun.log"; }
echo "logs: $LOG_DIR (exit $status)"
exit "$status"
