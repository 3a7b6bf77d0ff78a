"""What ``parallel.tp`` saves and costs: tensor bytes per rank and step time for tp = 1, 2, 4.

    python benchmarks/features/tensor_parallel.py --pp 1 --tps 1 2 4 --steps 12 --out benchmarks/RESULTS.md

For each tensor-parallel degree tp (world pp x tp, spawned gloo ranks, dp = 1), the same job (a
GPT wider than the default one, ``train.py``'s own :func:`~pipeflow.run.builder.build_run`) is
built and trained for ``--steps`` timed steps after two untimed ones.  Reported per rank:

- parameter, gradient and AdamW-state bytes, summed here over this rank's local shards (a
  DTensor's ``to_local()``, :func:`pipeflow.runtime.parallel.fsdp.local`; each storage once), at the end
  of step 1 after the optimizer step, before the gradients are released; and pipeflow's own
  accountant's figure for the same moment (:mod:`pipeflow.runtime.memory`) as a cross-check;
- the ratio of params + grads + optimizer to the same pipeline rank's at tp = 1 (its stage
  unsplit), beside the ratio expected from the parameter shapes and the model's plan: a
  parameter the plan splits counts numel / tp, one it leaves whole (LayerNorms, position
  embeddings, a row-wise layer's bias) numel, so the expected ratio is a little above 1 / tp;
- step time: median and range over the timed steps (the slowest rank, barrier to barrier).

The tp runs are separate worlds run one after the other (not round robin as in sharding.py):
their process counts differ.  On a CPU with fewer cores than ranks the times measure a shared
machine, not tensor parallelism's speed-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_per_degree, timed_train_steps  # noqa: E402
from benchmarks.features.sharding import compose  # noqa: E402
from pipeflow.run.builder import build_run  # noqa: E402
from pipeflow.runtime.parallel.fsdp import local  # noqa: E402
from pipeflow.runtime.memory import optimizer_state  # noqa: E402


def overrides(args: argparse.Namespace, tp: int, run_dir: str) -> list[str]:
    """``train.py``'s overrides for the job at degree `tp`."""
    return [f"parallel.tp={tp}", f"parallel.pp={args.pp}", "parallel.dp=1", f"schedule={args.schedule}",
            f"parallel.sequence_parallel={str(args.sequence_parallel).lower()}",
            f"pipeline.num_microbatches={args.microbatches}", f"data.batch_size={args.batch}",
            f"data.seq_len={args.seq}", f"data.vocab_size={args.vocab}", f"model.n_embd={args.width}",
            f"model.n_head={args.heads}", f"model.n_layer={args.layers}", f"train.max_steps={args.steps + 2}",
            "metrics.tensorboard=false", "metrics.progress_bar=false", "metrics.memory_steps=[1]",
            "pipeline.profile=false", "train.eval_every=0", f"train.run_dir={run_dir}"]


def _bytes(tensors) -> int:
    """Bytes of the local shards of `tensors`, each storage once."""
    seen, total = set(), 0
    for t in tensors:
        t = local(t)
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


SPLIT_STYLES = {"colwise": ("weight", "bias"), "colwise_qkv": ("weight", "bias"), "colwise_out": ("weight", "bias"),
                "embedding": ("weight",), "rowwise": ("weight",)}  # what each style of a plan splits over tp


def expected_bytes(trainer, tp: int) -> tuple[float, float]:
    """(the bytes of this rank's stages unsplit, the bytes expected at degree `tp`), from the
    parameters' global shapes and the model's plan (``ModelSpec.tensor_plan``): a parameter a
    style splits counts numel / tp, every other (norms, position embeddings, a row-wise layer's
    bias) numel.  Independent of the placements the split actually produced."""
    whole = expected = 0.0
    for sid, stage in trainer.parts.stages.items():
        for index, layer in zip(trainer.plan.layout.ranges[sid], stage.module):
            plan = trainer.plan.spec.tensor_plan(index, layer, tp) or {}
            split = {f"{path}.{name}".lstrip(".") for path, style in plan.items() for name in SPLIT_STYLES.get(style, ())}
            for name, p in layer.named_parameters():
                nbytes = p.numel() * p.element_size()  # a DTensor's numel is its global one
                whole += nbytes
                expected += nbytes / tp if name in split else nbytes
    return whole, expected


def measure(trainer, tp: int) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state bytes (local shards), and its stages'
    unsplit and expected parameter bytes (:func:`expected_bytes`)."""
    params = list({id(p): p for stage in trainer.parts.stages.values() for p in stage.module.parameters()}.values())
    whole, expected = expected_bytes(trainer, tp)
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _bytes(optimizer_state(trainer.loop.update.optimizer)), "whole": whole, "expected": expected}


@gloo_worker()
def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    tp = world // args.pp
    trainer = build_run(compose(overrides(args, tp, os.path.join(args.tmp, f"tp{tp}"))), torch.device("cpu"))
    memory: dict[str, float] = {}
    end = trainer._end

    def counted_end(step: int, accountant) -> None:  # after the optimizer step, before zero_grad
        if step == 1:
            memory.update(measure(trainer, tp))
        end(step, accountant)

    trainer._end = counted_end
    times = timed_train_steps(trainer, args.steps)
    resident = trainer.loop.memory.resident
    memory["accountant"] = resident.params + resident.grads + resident.optimizer
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (rank, memory, times))
    trainer.close()
    if rank == 0:
        queue.put(everyone)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f}"


def table(results: dict[int, list], args: argparse.Namespace) -> str:
    """One line per (tp, pipeline rank, tp rank) with its bytes and ratios, and one per tp with its step time."""
    head = (f"GPT {args.layers} blocks x {args.width}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
            f"global batch {args.batch}, m = {args.microbatches}, pp = {args.pp}, dp = 1, {args.schedule}, "
            f"sequence_parallel={str(args.sequence_parallel).lower()}, float32; MB per rank at the end of step 1 "
            "(after the optimizer step), local shards; ratio: p+g+o over the same pipeline rank's at tp = 1; "
            "expected: from the parameter shapes and the model's plan (split ones 1/tp)")
    lines = [head, "", "| tp | pipeline rank | tp rank | params | grads | optimizer | p+g+o | accountant p+g+o | "
             "ratio | expected | 1/tp |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    timing = ["", f"step time (ms, the slowest rank, {args.steps} steps): median [min-max], ratio to tp = 1", "",
              "| tp | processes | step ms | / tp=1 |", "| --- | --- | --- | --- |"]
    base_pgo: dict[int, float] = {}
    base_time = None
    for tp, everyone in sorted(results.items()):
        for rank, m, _ in sorted(everyone, key=lambda e: e[0]):
            r, t = (rank // tp) % args.pp, rank % tp
            pgo = m["params"] + m["grads"] + m["optimizer"]
            if tp == 1:
                base_pgo[r] = pgo
            ratio = f"{pgo / base_pgo[r]:.3f}" if r in base_pgo else "n/a"
            lines.append(f"| {tp} | {r} | {t} | {_mb(m['params'])} | {_mb(m['grads'])} | {_mb(m['optimizer'])} | "
                         f"{_mb(pgo)} | {_mb(m['accountant'])} | {ratio} | {m['expected'] / m['whole']:.3f} | "
                         f"{1 / tp:.3f} |")
        slowest = [max(ts[k] for _, _, ts in everyone) for k in range(args.steps)]
        med = 1e3 * statistics.median(slowest)
        base_time = base_time if base_time is not None else (med if tp == 1 else None)
        rel = f"{med / base_time:.2f}" if base_time else "n/a"
        timing.append(f"| {tp} | {tp * args.pp} | {med:.1f} [{1e3 * min(slowest):.1f}-{1e3 * max(slowest):.1f}] "
                      f"| {rel} |")
        print(f"tp={tp}: step {med:.1f} ms median, p+g+o rank 0 "
              f"{_mb(everyone[0][1]['params'] + everyone[0][1]['grads'] + everyone[0][1]['optimizer'])} MB",
              flush=True)
    return "\n".join(lines + timing)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--pp", type=int, default=1, help="pipeline degree (fixed; world = pp x tp)")
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel degrees")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (divisible by every tp)")
    parser.add_argument("--width", type=int, default=256, help="model.n_embd")
    parser.add_argument("--heads", type=int, default=8, help="model.n_head (divisible by every tp)")
    parser.add_argument("--layers", type=int, default=4, help="model.n_layer")
    parser.add_argument("--sequence-parallel", action="store_true", help="parallel.sequence_parallel=true")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per degree")
    args = parser.parse_args()
    results = spawn_per_degree(worker, args, args.tps, "tp")
    report("parallel.tp: tensor bytes per rank and step time", table(results, args), args.out)


if __name__ == "__main__":
    main()
