#!/usr/bin/env bash
# Survive a killed worker: run torchrun again, with train.resume=auto, until the run finishes.
#
#   examples/relaunch.sh model=mlp data=gaussian train.max_steps=1000 train.save_every=50
#
# Each launch continues the newest run under outputs/ whose config matches (train.resume=auto
# without train.run_dir; pipeflow/run/discover.py) from its last good checkpoint, so a launch that
# dies (a killed or crashed worker: every rank exits within seconds, pipeflow/run/guard.py) loses
# at most the steps since that checkpoint.  Pass train.run_dir=DIR to pin the directory instead.
#
# Settings (environment):
#   PIPEFLOW_ATTEMPTS      launches in all (default 3)
#   TORCHRUN_ARGS          torchrun's own arguments (default: --standalone --nproc-per-node 2); on
#                          several nodes run this script on every node with e.g.
#                          "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host:29500"
#   PIPEFLOW_RELAUNCH_DELAY_S  seconds between launches (default 2: the dead job's port is freed)
#   PYTHON                 the interpreter (default python)
# Each launch gets PIPEFLOW_ATTEMPT=0, 1, ... (fault drills: PIPEFLOW_FAULT_INJECT=...:attempt=0).
# A launch that was preempted (SIGTERM from a scheduler: saved, status 75) is not relaunched here:
# the script exits 75 at once, for the scheduler's requeue to continue the run on a new allocation.
#
# Each launch runs python -m pipeflow.launch (torchrun that exits 75 on a preemption).
# Why not torchrun --max-restarts: on gloo, torch's own restart fails (static rendezvous: connection
# refused; c10d: sometimes hangs in init_process_group), reproduced without pipeflow; a fresh
# torchrun per attempt does not share that state.  On NCCL the same loop works unchanged.
set -u
attempts=${PIPEFLOW_ATTEMPTS:-3}
torchrun_args=${TORCHRUN_ARGS:---standalone --nproc-per-node 2}
here=$(cd "$(dirname "$0")/.." && pwd)
status=1
for ((attempt = 0; attempt < attempts; attempt++)); do
    export PIPEFLOW_ATTEMPT=$attempt
    echo "[relaunch] launch $((attempt + 1)) of $attempts" >&2
    # shellcheck disable=SC2086 # torchrun_args is a list of words
    "${PYTHON:-python}" -m pipeflow.launch $torchrun_args "$here/train.py" train.resume=auto "$@" && exit 0
    status=$?
    if [ "$status" -eq 75 ]; then
        echo "[relaunch] launch $((attempt + 1)) was preempted (saved); exiting with status 75" >&2
        exit 75
    fi
    echo "[relaunch] launch $((attempt + 1)) exited with status $status" >&2
    [ $((attempt + 1)) -lt "$attempts" ] && sleep "${PIPEFLOW_RELAUNCH_DELAY_S:-2}"
done
echo "[relaunch] giving up after $attempts launches" >&2
exit "$status"
