"""What ``parallel.shard`` saves and costs: tensor bytes per rank and step time, side by side.

    python benchmarks/features/sharding.py --pp 2 --dps 1 2 4 --steps 12 --out benchmarks/RESULTS.md

For each data-parallel degree dp (world dp x pp, spawned gloo ranks), the same job (the default
GPT, ``train.py``'s own :func:`~pipeflow.run.builder.build_run`) is built three times in one
world, once per ``parallel.shard`` mode (none, optimizer, full), and their training steps run
round robin, the mode that goes first rotating every step, so that each mode meets the same
machine load.  Reported per mode:

- tensor bytes per rank (pipeflow's accountant, :mod:`pipeflow.runtime.memory`, counted from the
  live tensors: a DTensor's local shard, ZeRO's owned state), resident at the step's end (after
  the optimizer step, before the gradients are released): parameters, gradients, optimizer
  state; and the in-step peak of parameters (``full`` gathers a stage's parameters for its step);
- the bounds the issue sets: ``optimizer`` holds at most 1/dp of the unsharded optimizer bytes
  plus the largest single parameter's state (ZeRO-1 assigns whole tensors), ``full`` likewise
  for parameters + gradients + optimizer state;
- step time: median and range over the timed steps (the slowest rank, barrier to barrier).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_per_degree  # noqa: E402
from pipeflow.run.builder import build_run  # noqa: E402
from pipeflow.config.schema import register_configs  # noqa: E402

MODES = ("none", "optimizer", "full")


def compose(overrides: list[str]):
    """The config ``train.py`` would resolve with `overrides`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


@gloo_worker()
def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    dp = world // args.pp
    base = [f"parallel.dp={dp}", f"parallel.pp={args.pp}", f"schedule={args.schedule}",
            f"pipeline.num_microbatches={args.microbatches}", f"data.batch_size={args.batch}",
            f"model.n_embd={args.width}", f"model.n_layer={args.layers}", f"train.max_steps={args.steps + 2}",
            "metrics.tensorboard=false", "metrics.progress_bar=false", "metrics.memory_steps=[1]",
            "pipeline.profile=false", "comm.post_recvs=ahead", "train.eval_every=0"]
    trainers = {}
    for mode in MODES:
        run_dir = os.path.join(args.tmp, f"dp{dp}_{mode}")
        trainers[mode] = build_run(compose([*base, f"parallel.shard={mode}", f"train.run_dir={run_dir}"]),
                                   torch.device("cpu"))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    memory = {}
    for step in range(args.steps + 2):
        order = MODES[step % 3:] + MODES[:step % 3]
        for mode in order:
            dist.barrier()
            start = time.perf_counter()
            trainers[mode].train_step(step)
            dist.barrier()
            if step >= 2:  # step 0 builds shapes and optimizer state, step 1 is measured for memory
                times[mode].append(time.perf_counter() - start)
            if step == 1:
                accountant = trainers[mode].loop.memory
                memory[mode] = (accountant.resident, accountant.peak, _largest_parameter(trainers["none"]))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (rank, memory, times))
    for trainer in trainers.values():
        trainer.close()
    if rank == 0:
        queue.put(everyone)


def _largest_parameter(trainer) -> int:
    """Bytes of the largest of this rank's parameters (`trainer` unsharded)."""
    return max(p.numel() * p.element_size() for stage in trainer.parts.stages.values() for p in stage.module.parameters())


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f}"


def table(results: dict[int, list], args: argparse.Namespace) -> str:
    """The memory table (per pipeline rank, its dp ranks' largest figure) and the time table."""
    lines = [f"GPT {args.layers} blocks x {args.width}, pp = {args.pp}, {args.schedule}, m = {args.microbatches}, "
             f"global batch {args.batch}; tensor MB per rank (the largest over a pipeline rank's dp replicas), "
             "resident at the step's end; bounds: 1/dp of `none` plus the largest parameter's share",
             "", "| dp | shard | pipeline rank | params | grads | optimizer | p+g+o | in-step params | "
             "optimizer bound | p+g+o bound | within |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    timing = ["", f"step time (ms, the slowest rank, {args.steps} steps round robin): median [min-max], ratio to `none`",
              "", "| dp | none | optimizer | full | optimizer / none | full / none |", "| --- | --- | --- | --- | --- | --- |"]
    for dp, everyone in sorted(results.items()):
        by_pp: dict[int, dict[str, list]] = {}
        for rank, memory, _ in everyone:
            for mode, figures in memory.items():
                by_pp.setdefault(rank % args.pp, {}).setdefault(mode, []).append(figures)
        for r, modes in sorted(by_pp.items()):
            base = max(modes["none"], key=lambda f: f[0].total)[0]
            largest = modes["none"][0][2]  # bytes of the largest parameter; its AdamW state is twice that
            for mode in MODES:
                resident, peak, _ = max(modes[mode], key=lambda f: f[0].total)
                pgo = resident.params + resident.grads + resident.optimizer
                opt_bound = base.optimizer / dp + 2 * largest
                pgo_bound = (base.params + base.grads + base.optimizer) / dp + 4 * largest
                ok = {"none": True, "optimizer": resident.optimizer <= opt_bound, "full": pgo <= pgo_bound}[mode]
                lines.append(f"| {dp} | {mode} | {r} | {_mb(resident.params)} | {_mb(resident.grads)} | "
                             f"{_mb(resident.optimizer)} | {_mb(pgo)} | {_mb(peak.params)} | "
                             f"{_mb(opt_bound) if mode == 'optimizer' else ''} | {_mb(pgo_bound) if mode == 'full' else ''} | "
                             f"{'yes' if ok else 'NO'} |")
        slowest = {mode: [max(ts[mode][k] for _, _, ts in everyone) for k in range(args.steps)] for mode in MODES}
        med = {mode: 1e3 * statistics.median(ts) for mode, ts in slowest.items()}
        cells = [f"{med[m]:.1f} [{1e3 * min(slowest[m]):.1f}-{1e3 * max(slowest[m]):.1f}]" for m in MODES]
        timing.append(f"| {dp} | {' | '.join(cells)} | {med['optimizer'] / med['none']:.2f} | {med['full'] / med['none']:.2f} |")
    return "\n".join(lines + timing)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    args = parser.parse_args()
    results = spawn_per_degree(worker, args, args.dps, "dp")
    report("parallel.shard: tensor bytes per rank and step time", table(results, args), args.out)


if __name__ == "__main__":
    main()
