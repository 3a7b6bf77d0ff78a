#!/usr/bin/env bash
# Train on several machines: run this same command on every node (torchrun's c10d rendezvous
# gathers them; any node's address can serve as the endpoint). Hydra overrides follow.
#
#   NNODES=2 NPROC=8 ENDPOINT=10.0.0.1:29500 examples/multinode.sh parallel.dp=4 parallel.pp=4
#
# It runs python -m pipeflow.launch (torchrun, plus): each node finds its own address on the
# route to ENDPOINT and passes it as --local-addr (torchrun would publish the hostname, which
# other hosts may not resolve, or which resolves to 127.0.0.1), sets GLOO_SOCKET_IFNAME and
# NCCL_SOCKET_IFNAME to that interface unless you set them, and the node that owns ENDPOINT's
# address hosts the rendezvous; a node that cannot reach ENDPOINT stops at once saying why.
# Exit status: 0 done, 75 preempted (saved: run it again with train.resume=auto), else failed.
#
# Settings (environment):
#   NNODES    nodes: N, or MIN:MAX for an elastic job (e.g. 1:2 survives losing a node)
#   NPROC     processes per node (one per GPU)
#   ENDPOINT  host:port of the rendezvous, on one of the nodes (an IP is safest)
#   RUN_ID    the rendezvous id, the same on every node (default pipeflow)
#   TORCHRUN_ARGS  more torchrun options (e.g. "--max-restarts 3")
#   PYTHON    the interpreter (default python3)
#
# Global rank = node rank * NPROC + local rank; docs/start/4-scale-out.md says where each rank's stage goes.
# Checkpoints (train.save_every): train.run_dir on a file system every node sees, or
# train.checkpoint_storage=local (each node keeps its own part; python -m pipeflow.checkpoint
# gather merges the parts). An elastic job (NNODES=1:2) needs a layout that fits the smaller
# world: parallel.dp=auto with a parallel.pp that divides the ranks left.
set -euo pipefail
NNODES=${NNODES:-2}
NPROC=${NPROC:-8}
ENDPOINT=${ENDPOINT:?set ENDPOINT=host:port of one node}
RUN_ID=${RUN_ID:-pipeflow}
cd "$(dirname "$0")/.."
# shellcheck disable=SC2086 # TORCHRUN_ARGS is a list of words
exec "${PYTHON:-python3}" -m pipeflow.launch --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$ENDPOINT" --rdzv-id "$RUN_ID" ${TORCHRUN_ARGS:-} train.py "$@"
