#!/usr/bin/env bash
# Template: train the example on 2 Ascend servers x 8 NPUs (16 ranks, dp=2 x tp=8) with msrun.
# Run it on every server with NODE_RANK=0 on the first and 1 on the second; MASTER_ADDR is the
# first server's IP address, reachable from the second. Adjust the counts, the network
# interface and the flags of examples/train_tp.py to your cluster.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${MASTER_ADDR:?set MASTER_ADDR to the IP address of the first server}"
: "${NODE_RANK:?set NODE_RANK to 0 on the first server and 1 on the second}"
NODES="${NODES:-2}" NPUS_PER_NODE="${NPUS_PER_NODE:-8}" MASTER_PORT="${MASTER_PORT:-8118}"
source "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/set_env.sh"   # CANN environment
export HCCL_SOCKET_IFNAME="${HCCL_SOCKET_IFNAME:-eth0}"    # NIC used for HCCL's host-side setup traffic
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-600}" # seconds to wait for all ranks to connect
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
msrun --worker_num=$((NODES * NPUS_PER_NODE)) --local_worker_num="$NPUS_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" \
  --log_dir="$ROOT/rank_logs/train_tp_node$NODE_RANK" --join=True --cluster_time_out=600 \
  "$ROOT/examples/train_tp.py" --device Ascend --dp "$NODES" --tp "$NPUS_PER_NODE" --mode graph --steps 10 \
  --batch 16 --seq 256 --dim 1024 --hidden 4096 --vocab 32000 --layers 4 --heads 16
