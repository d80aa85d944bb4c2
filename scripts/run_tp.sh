#!/usr/bin/env bash
# Main job: set up the virtualenv (first run only), train the Llama-style example with tensor
# (and data) parallelism on N ranks with msrun, check it against a single-device run, and
# print rank 0's log and summary.
# Usage: bash scripts/run_tp.sh [--nproc 4] [--tp 2] [--dp 2] [--cp 2] [--device CPU|Ascend] [--mode graph|jit|pynative]
#                               [--steps 10] [--port 8128] [--fsdp [--hsdp-replicate R]]
#                               [--pp 2 [--schedule gpipe|1f1b|interleaved|zb] [--microbatches M]] [-- extra train_tp.py flags]
# --fsdp shards parameters, gradients and optimizer state over dp (fully_shard, PyNative; the mode
# defaults to pynative with it); --hsdp-replicate R makes it HSDP with R replicas.
# --pp N splits the model into pipeline stages over pp x dp x tp ranks (PyNative; interleaved and zb
# need 2 N layers, given with -- --layers 4).
# --cp C splits each sequence over C context-parallel ranks (pp x dp x cp x tp ranks, PyNative; --nproc
# defaults to that product), e.g. --cp 2 --tp 1 (2 ranks), --cp 2 --tp 2, --cp 2 --dp 2 --fsdp (fully_shard
# over the flattened dp x cp ranks) or --cp 2 --pp 2 (4 ranks); with -- --activation-checkpoint full|selective|
# attention_core, --checkpoint-dir / --save-every / --resume; not with --hsdp-replicate or --compile-stages.
# Flags after -- go to examples/train_tp.py, e.g. -- --clip-grad-norm 1.0 --activation-checkpoint full
# (clipping by the whole model's gradient norm; attention and feed-forward checkpointed; selective: PyNative).
# --ep E trains the DeepSeek-style MoE example instead (examples/train_moe.py, PyNative): the experts over E
# ranks, with --tp T (default 1) also the dense parts and each expert's hidden features over T (E x T ranks);
# losses, gradient norms and parameters checked against one device, e.g. --ep 2 --steps 3, --ep 2 --tp 2;
# -- --activation-checkpoint full|selective checkpoints each MoE block (its dispatch recomputed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPROC=4 TP="" DP="" CP=1 DEVICE=CPU MODE="" STEPS=10 PORT=8128 EXTRA=() FSDP=() PP=1 PIPE=()
EP="" NPROC_SET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) NPROC="$2"; NPROC_SET=1; shift 2 ;;
    --ep) EP="$2"; shift 2 ;;
    --tp) TP="$2"; shift 2 ;;
    --dp) DP="$2"; shift 2 ;;
    --cp) CP="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --mode) MODE="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --fsdp) FSDP+=(--fsdp); shift ;;
    --hsdp-replicate) FSDP+=(--hsdp-replicate "$2"); shift 2 ;;
    --pp) PP="$2"; shift 2 ;;
    --schedule) PIPE+=(--schedule "$2"); shift 2 ;;
    --microbatches) PIPE+=(--microbatches "$2"); shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown argument: $1 (see the usage line at the top of $0)" >&2; exit 2 ;;
  esac
done
# launch SCRIPT ARGS...: msrun NPROC ranks of examples/SCRIPT.py into rank_logs/SCRIPT, print rank 0's
# step lines, the first error lines of every rank and the summary line, and exit with msrun's status.
launch() {
  local name="$1"; shift
  bash "$ROOT/scripts/setup_env.sh"     # first run: create the venv (progress shown here)
  local log_dir="$ROOT/rank_logs/$name" status=0
  rm -rf "$log_dir"
  mkdir -p "$log_dir"
  export GLOG_v="${GLOG_v:-3}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  bash "$ROOT/scripts/msrun.sh" --worker_num="$NPROC" --local_worker_num="$NPROC" --master_port="$PORT" \
    --log_dir="$log_dir" --join=True "$ROOT/examples/$name.py" "$@" > "$log_dir.msrun.log" 2>&1 || status=$?
  grep -h "^\[parallel\]\|^\[single device\]" "$log_dir/worker_0.log" 2>/dev/null || true
  for k in $(seq 0 $((NPROC - 1))); do
    grep -h "Traceback\|Error" "$log_dir/worker_$k.log" 2>/dev/null | head -n 5 || true
  done
  grep -h "^$name:" "$log_dir/worker_0.log" || { echo "no summary: see $log_dir and $log_dir.msrun.log"; tail -n 30 "$log_dir.msrun.log"; }
  echo "logs: $log_dir (exit $status)"
  exit "$status"
}
if [ -n "$EP" ]; then
  if [ -n "$MODE" ] && [ "$MODE" != pynative ]; then
    echo "--ep runs in --mode pynative (the token moves follow the router's run-time counts), not $MODE" >&2; exit 2
  fi
  if [ -n "$DP" ] || [ ${#FSDP[@]} -gt 0 ] || [ "$PP" -gt 1 ]; then
    echo "--ep borrows the data-parallel ranks (each ep rank trains on its own rows): drop --dp, --fsdp and --pp" >&2
    exit 2
  fi
  TP="${TP:-$([ -n "$NPROC_SET" ] && echo $(( NPROC / EP )) || echo 1)}"
  if [ -n "$NPROC_SET" ] && [ $(( EP * TP )) -ne "$NPROC" ]; then
    echo "ep ($EP) x tp ($TP) must equal --nproc ($NPROC)" >&2; exit 2
  fi
  NPROC=$(( EP * TP ))
  launch train_moe --ep "$EP" --tp "$TP" --steps "$STEPS" --device "$DEVICE" "${EXTRA[@]}"
fi
if [ -z "$MODE" ]; then MODE=$([ ${#FSDP[@]} -gt 0 ] || [ "$PP" -gt 1 ] || [ "$CP" -gt 1 ] && echo pynative || echo graph); fi
if [ "$CP" -gt 1 ] && [ -z "$NPROC_SET" ]; then NPROC=$(( PP * ${DP:-1} * CP * ${TP:-1} )); fi
TP="${TP:-$(( NPROC / PP / CP >= 2 ? 2 : 1 ))}"
DP="${DP:-$(( NPROC / PP / CP / TP ))}"
if [ $(( PP * DP * CP * TP )) -ne "$NPROC" ]; then
  echo "pp ($PP) x dp ($DP) x cp ($CP) x tp ($TP) must equal --nproc ($NPROC)" >&2; exit 2
fi
launch train_tp --pp "$PP" --dp "$DP" --cp "$CP" --tp "$TP" --mode "$MODE" --steps "$STEPS" --device "$DEVICE" \
  "${FSDP[@]}" "${PIPE[@]}" "${EXTRA[@]}"
