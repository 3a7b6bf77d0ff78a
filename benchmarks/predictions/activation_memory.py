"""Peak activation memory per rank for each schedule, measured, beside the simulator's prediction.

    python benchmarks/predictions/activation_memory.py --ranks 4 --microbatches 8 --schedules gpipe 1f1b zb_h1 zbv

Each rank runs one training step of an MLP (Linear + GELU layers, --hidden wide,
--layers-per-stage per stage, batch --batch) on gloo and, after every compute action, counts
the bytes it holds for backward: the storages autograd saved (tracked with
``torch.autograd.graph.saved_tensors_hooks``; parameters excluded) plus the stage's kept inputs
and outputs, each storage once.  Dividing by what one micro-batch on one stage holds gives the
measured peak in micro-batches, next to ``SimResult.peak_activations`` (the simulator's count
of (stage, micro-batch) pairs held, which for 1F1B is p on rank 0 and for GPipe m).  The step
runs twice, with sent activations freed (the default) and kept, to show what freeing saves.
With --out the table is appended to that file with command, machine, torch version and date.
"""
from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from pipeflow.runtime.transport import P2PComm  # noqa: E402
from benchmarks.runner import benchmark_parser, gloo_worker, microbatches, mse, report, spawn_ranks  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.schedules import build_schedule, simulate  # noqa: E402
from pipeflow.runtime.stage import Stage  # noqa: E402


class _Saved:
    """What a pack hook returns: the tensor, registered as live until autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class HeldBytes:
    """Counts the activation bytes a rank holds: live saved tensors plus the stages' kept tensors."""

    def __init__(self, stages: dict[int, Stage]) -> None:
        self.stages = stages
        self.params = {p.untyped_storage().data_ptr() for st in stages.values() for p in st.parameters()}
        self.saved: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        self.saved.add(saved)
        return saved

    def now(self) -> int:
        """Bytes held right now, each storage once."""
        storages: dict[int, int] = {}
        tensors = [s.tensor for s in list(self.saved)]
        for stage in self.stages.values():
            for kept in (stage._inputs, stage._outputs):
                tensors += [t for ts in kept.values() for t in ts]
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params and storage.nbytes() > 0:
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def sample(self) -> None:
        """Record the current bytes if they are a new peak."""
        self.peak = max(self.peak, self.now())


def one_microbatch_bytes(args: argparse.Namespace) -> int:
    """What one micro-batch holds on one (middle) stage after its forward."""
    stage = Stage(1, 3, make_layers(args))
    tracker = HeldBytes({1: stage})
    x = torch.randn(args.batch // args.microbatches, args.hidden, requires_grad=True)
    with tracker.hooks:
        stage.forward(0, (x,))
    return tracker.now()


def make_layers(args: argparse.Namespace) -> list[nn.Module]:
    """One stage's layers."""
    return [nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.GELU()) for _ in range(args.layers_per_stage)]


def measure(name: str, p: int, args: argparse.Namespace, free: bool) -> tuple[int, int]:
    """(this rank's peak held bytes, the simulator's peak (stage, micro-batch) pairs on it)."""
    m, rank = args.microbatches, dist.get_rank()
    schedule = build_schedule(name, p, m)
    S = schedule.num_stages
    torch.manual_seed(rank)
    stages = {s: Stage(s, S, make_layers(args), mse) for s in schedule.stages_of(rank)}
    pipe = Pipeline(stages, schedule, P2PComm(None, torch.device("cpu"), timeout_s=300))
    if not free:  # the "before": sent activations keep their storage until backward
        for stage in stages.values():
            stage.deallocate_outputs = lambda i: None  # type: ignore[method-assign]
    tracker = HeldBytes(stages)
    compute = pipe._compute

    def sampled(*a, **k):  # count after every action (wraps the pipeline for this benchmark only)
        compute(*a, **k)
        tracker.sample()

    pipe._compute = sampled  # type: ignore[method-assign]
    x = torch.randn(args.batch, args.hidden)
    inputs, targets = microbatches(x, x, m, stages, S)
    with tracker.hooks:
        pipe.run(inputs, targets)
    return tracker.peak, simulate(schedule).peak_activations[rank]


@gloo_worker()
def worker(rank: int, p: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    P2PComm(None, torch.device("cpu")).warmup()
    rows = []
    for name in args.schedules:
        freed, predicted = measure(name, p, args, free=True)
        kept, _ = measure(name, p, args, free=False)
        rows.append((name, rank, freed, kept, predicted))
    gathered: list[list] = [[] for _ in range(p)]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        queue.put(sorted(r for rows in gathered for r in rows))


def table(rows: list[tuple], unit: int, args: argparse.Namespace) -> str:
    """The results as a Markdown table."""
    lines = [
        f"MLP width {args.hidden}, {args.layers_per_stage} Linear+GELU layers per stage, batch "
        f"{args.batch}, m = {args.microbatches}, p = {args.ranks}; one micro-batch on one stage "
        f"holds {unit / 1024:.1f} KiB",
        "",
        "| schedule | rank | peak held, sent activations freed (KiB) | in micro-batches | "
        "peak held, kept (KiB) | in micro-batches | simulator's peak (micro-batches) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rank, freed, kept, predicted in rows:
        lines.append(
            f"| {name} | {rank} | {freed / 1024:.1f} | {freed / unit:.2f} | {kept / 1024:.1f} "
            f"| {kept / unit:.2f} | {predicted} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    report("Peak activation memory per rank", table(spawn_ranks(worker, args), one_microbatch_bytes(args), args), args.out)


if __name__ == "__main__":
    main()
