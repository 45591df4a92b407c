#!/usr/bin/env bash
# Start DDP training on several machines: run THIS SAME SCRIPT on every node.
#
# Each node starts NPROC processes (one per GPU) with torchrun. The torchrun agents of all
# nodes first meet at a rendezvous endpoint, HOST:PORT, a TCP store that torchrun's c10d
# backend starts on the machine named HOST (pick one of the nodes, say node 0, and a port
# that is free there and reachable from the others). Together they agree on WORLD_SIZE =
# NNODES x NPROC and hand every process its RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
#
#   on node 0 (host node0):  NODE_RANK=0 RDZV_ENDPOINT=node0:29500 bash course/scripts/multinode_torchrun.sh
#   on node 1:               NODE_RANK=1 RDZV_ENDPOINT=node0:29500 bash course/scripts/multinode_torchrun.sh
#
# which runs, on node 1 for instance (2 nodes of 8 GPUs: 16 processes in all):
#
#   torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-id ddp-demo \
#       --rdzv-backend c10d --rdzv-endpoint node0:29500 course/scripts/ddp_train.py --data fashion
#
# Settings (environment variables):
#   NNODES          number of machines (default 2)
#   NODE_RANK       this machine's number, 0..NNODES-1 (default 0). The c10d backend orders the
#                   nodes itself (torchrun then logs that it ignores --node-rank); with
#                   RDZV_BACKEND=static the node ranks are exactly these numbers, and the node
#                   with NODE_RANK=0 must be the one named in RDZV_ENDPOINT.
#   RDZV_ENDPOINT   HOST:PORT of the rendezvous, the same on every node (default localhost:29500,
#                   which only makes sense for a one-node try-out)
#   RDZV_BACKEND    c10d (default; fault tolerant, any node order) or static
#   RDZV_ID         a name for this job, the same on every node (default ddp-demo)
#   NPROC           processes per node (default: the number of GPUs here, or 2 without GPUs)
#   TRAIN_SCRIPT    the training script (default course/scripts/ddp_train.py)
# Anything after the script's name is passed to the training script, e.g.
#   bash course/scripts/multinode_torchrun.sh --data fashion --epochs 10 --checkpoint-dir /shared/ckpt
# Rank 0 writes the checkpoint: give --checkpoint-dir a folder that every node can read
# (a shared file system) if you want to resume on all of them.
#
# If it hangs at the start: a firewall between the nodes (the endpoint's port, and NCCL's own
# ports, must be reachable), or a node that never started. Every process gives up after the
# training script's --timeout; torchrun's own rendezvous waits up to 900 s by default.
# NCCL_DEBUG=INFO shows which network interface NCCL picked (set NCCL_SOCKET_IFNAME to choose).
set -euo pipefail

NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-localhost:29500}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
RDZV_ID="${RDZV_ID:-ddp-demo}"
if [[ -z "${NPROC:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        NPROC="$(nvidia-smi -L | wc -l)"
    else
        NPROC=2  # no GPU: CPU processes stand in for GPUs (gloo)
    fi
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$HERE/ddp_train.py}"
# The torchrun of the course's virtual environment if there is one, else the one on PATH.
TORCHRUN="${TORCHRUN:-$HERE/../../.venv/bin/torchrun}"
[[ -x "$TORCHRUN" ]] || TORCHRUN=torchrun

echo "node $NODE_RANK of $NNODES: $NPROC process(es), rendezvous $RDZV_BACKEND at $RDZV_ENDPOINT" >&2
exec "$TORCHRUN" \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC" \
    --rdzv-id "$RDZV_ID" \
    --rdzv-backend "$RDZV_BACKEND" \
    --rdzv-endpoint "$RDZV_ENDPOINT" \
    "$TRAIN_SCRIPT" "$@"
