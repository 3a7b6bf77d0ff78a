#!/usr/bin/env bash
# Train on several machines: run this same command on every node (torchrun's c10d rendezvous
# gathers them; any node's address can serve as the endpoint). Hydra overrides follow.
#
#   NNODES=2 NPROC=8 ENDPOINT=node0.example:29500 examples/multinode.sh parallel.dp=4 parallel.pp=4
#
# Global rank = node rank * NPROC + local rank, and the ranks of one pipeline are consecutive
# (pipeline rank r of replica d is global rank d * pp + r): with pp <= NPROC a pipeline stays
# inside a node (P2P on NVLink), and only the once-per-step dp all-reduce crosses nodes.
# Checkpoints (train.save_every) need a directory every node sees (train.run_dir on a shared FS).
set -euo pipefail
NNODES=${NNODES:-2}
NPROC=${NPROC:-8}
ENDPOINT=${ENDPOINT:?set ENDPOINT=host:port of one node}
RUN_ID=${RUN_ID:-pipeflow}
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$ENDPOINT" --rdzv-id "$RUN_ID" train.py "$@"
