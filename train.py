"""Train a model split into pipeline stages.

One machine, 4 processes (one pipeline stage each):
    torchrun --nproc-per-node 4 train.py
Overrides (Hydra):
    torchrun --nproc-per-node 2 train.py schedule=gpipe pipeline.num_microbatches=4 train.max_steps=50
Several machines (run on each node, same endpoint):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host:29500 train.py
Without torchrun, `python train.py` runs a pipeline of one stage.
A sweep, every combination in one launch, compared in <sweep dir>/sweep.md (pipeflow/commands/sweep.py):
    torchrun --nproc-per-node 4 train.py -m schedule=1f1b,zbv pipeline.num_microbatches=8,16 train.max_steps=20
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading

import hydra
import torch.distributed as dist
from omegaconf import DictConfig

from pipeflow.run import guard
from pipeflow.config.schema import check_values, register_configs
from pipeflow.observability.console import setup_logging
from pipeflow.runtime.world.distributed import choose_device, end_process_group, init_distributed
from pipeflow.commands.sweep import is_multirun, run_sweep_job
from pipeflow.run.builder import build_run
from pipeflow.run.signals import PREEMPTED_EXIT_CODE, leave_at_once_on, signal_numbers

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    """Set up the process group, train, tear the groups down (end_process_group); on any failure
    exit 1 at once (guard.fail)."""
    # a rank that aborts in native code (SIGABRT, SIGSEGV) prints every thread's Python stack
    faulthandler.enable(all_threads=True)
    backend, device = choose_device(cfg.dist.backend, cfg.dist.device)
    setup_logging(int(os.environ.get("RANK", "0")))
    try:  # a rank that never joins is named (comm.join_timeout_s), not waited for
        check_values(cfg)  # counts and deadlines first: a bad comm.join_timeout_s is not a missing rank
        init_distributed(backend, device, cfg.comm.first_step_timeout_s, cfg.comm.join_timeout_s)
    except BaseException as exc:  # noqa: BLE001 - every failure is named and ends the process
        guard.fail(exc, int(os.environ.get("RANK", "0")))
    if is_multirun():  # train.py -m: the jobs of a sweep share one process group (pipeflow/commands/sweep.py)
        run_sweep_job(cfg, device)
        return
    rank, training = dist.get_rank(), threading.Event()
    watchers = []
    if dist.get_world_size() > 1:  # a rank that is not in a transfer leaves when another has failed
        watchers.append((training, guard.watch_for_failures(rank, stop=training)))
    try:
        # a signal during start-up leaves at once (nothing trained yet); fit() saves on one from its first evaluation
        startup = leave_at_once_on(signal_numbers(cfg.train.save_on_signal), rank, guard.leave)
        try:
            result = build_run(cfg, device).fit()
        finally:
            startup()  # from here a signal ends the process as usual: the run is over, or failed
        # Stop and join the failure watch (from here the store may go away with a rank that is
        # done), wait for every rank (bounded), then destroy the groups: a thread still in a store
        # call, or a group destroyed while a peer still uses it, aborts at exit (exit -6).
        clean = end_process_group(cfg.comm.timeout_s, watchers)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        guard.fail(exc, rank)  # logs, names the job's first failure, exits 1 at once
    code = PREEMPTED_EXIT_CODE if result.get("preempted_at") is not None else 0  # preempted: saved; relaunch to go on
    if not clean:  # a watcher still inside a store call: skip the interpreter's finalization
        guard.leave(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
