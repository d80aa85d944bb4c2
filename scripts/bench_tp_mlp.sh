#!/usr/bin/env bash
# Benchmark b: the same tensor-parallel MLP training step in hyper_parallel_ms (MindSpore) and in
# PyTorch 2.13 (torch.distributed.tensor.parallel, gloo, torchrun), each against its own
# hand-written floor (local shards + explicit all-reduces), on 2 and 4 CPU ranks.
# PyTorch goes into its own virtualenv (.venv-torch, created on first use: pip install torch==2.13.0).
# Usage: bash scripts/bench_tp_mlp.sh [--ranks "2 4"] [--steps 20] [--dim 512] [--hidden 2048]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RANKS="2 4" STEPS=20 DIM=512 HIDDEN=2048
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --dim) DIM="$2"; shift 2 ;;
    --hidden) HIDDEN="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
bash "$ROOT/scripts/setup_env.sh"
TORCH_VENV="${HPMS_TORCH_VENV:-$ROOT/.venv-torch}"
if ! "$TORCH_VENV/bin/python" -c "import torch" 2>/dev/null; then
  python3 -m venv "$TORCH_VENV"
  "$TORCH_VENV/bin/pip" install -q torch==2.13.0 "numpy<2"
fi
export OMP_NUM_THREADS=1 GLOG_v=3
for n in $RANKS; do
  "$TORCH_VENV/bin/torchrun" --nproc_per_node "$n" --master_port 29517 "$ROOT/scripts/bench_torch_tp.py" \
    --dim "$DIM" --hidden "$HIDDEN" --steps "$STEPS" 2>/dev/null | grep "^torch"
done
"$ROOT/.venv/bin/python" "$ROOT/scripts/bench_tp_mlp.py" --ranks "${RANKS// /,}" --dim "$DIM" --hidden "$HIDDEN" \
  --steps "$STEPS" 2>&1 | grep "^mindspore"
