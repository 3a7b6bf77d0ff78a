"""How much of a checkpoint's write ``train.checkpoint_mode=async|async_process`` hides from training.

    python benchmarks/features/async_checkpoint.py --rounds 5 --out benchmarks/RESULTS.md

One process (a gloo group of one, torch on one thread: the other core is free, as a GPU job's
host is) trains a stack of ``--layers`` Linear layers of ``--width`` (float32, AdamW: parameters
and the optimizer's two moments are the state saved, a few hundred MB) on a batch of ``--batch``
rows.  Each round times, in turn, a window of ``--save-every`` + 1 steps four ways: no save (the
baseline), a synchronous save after the first step (``pipeflow.checkpoint.saving.save``), and a save
staged after the first step and written in the background by each mode
(:class:`~pipeflow.checkpoint.background.BackgroundSaver`, its report polled at every step
boundary as the Trainer polls it; a write still running at the window's end is waited for,
inside the window).  With W = sync's window - the baseline (what a synchronous write costs),
each mode hides ``1 - (its window - the baseline) / W`` of it; medians over the rounds.  The
writer process of ``async_process`` is started by a save before the rounds (its start, once per
run, is not counted).
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.runner import benchmark_parser, report  # noqa: E402
from pipeflow.checkpoint import saving as checkpoint  # noqa: E402
from pipeflow.checkpoint.background import BackgroundSaver  # noqa: E402

MODES = ("async", "async_process")


class Job:
    """The layers, their optimizer, one batch, and a training step over them."""

    def __init__(self, layers: int, width: int, batch: int) -> None:
        torch.manual_seed(0)
        self.layers = {i: torch.nn.Linear(width, width) for i in range(layers)}
        self.params = [p for layer in self.layers.values() for p in layer.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.batch = torch.randn(batch, width)
        self.step()  # the optimizer's state exists before any save

    def step(self) -> None:
        """One forward, backward and AdamW update."""
        x = self.batch
        for layer in self.layers.values():
            x = torch.relu(layer(x))
        x.square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes saved: the parameters and the optimizer's tensors."""
        optimizer = sum(t.nbytes for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t))
        return sum(p.nbytes for p in self.params) + optimizer


def window(job: Job, steps: int, save: str, root: str, saving_step: int, savers: dict[str, BackgroundSaver]) -> float:
    """Seconds of `steps` training steps, the first followed by a save of kind `save` (``none``,
    ``sync`` or a background mode), the background save's report polled at every boundary and
    waited for at the end if still running."""
    started = time.perf_counter()
    for k in range(steps):
        job.step()
        saver = savers.get(save)
        if saver is not None:
            saver.poll()
        if k == 0 and save == "sync":
            checkpoint.save(root, saving_step, job.layers, job.opt, {"scaler": {}}, job="bench", keep_last=1)
        elif k == 0 and saver is not None:
            saver.save(root, saving_step, job.layers, job.opt, {"scaler": {}}, job="bench", keep_last=1)
    for saver in savers.values():
        saver.wait("the window's end")
    return time.perf_counter() - started


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    # at 8 here the thread writer, sharing the free core with DCP's and the hash's Python, had not
    # finished by the window's end (its wait counted); runs save far less often than every 16 steps
    parser.add_argument("--save-every", type=int, default=16, help="steps after the saving step in each window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    folder = tempfile.mkdtemp(prefix="pf-async-bench-", dir=args.dir)
    job = Job(args.layers, args.width, args.batch)
    savers = {mode: BackgroundSaver(mode, "stop", torch.device("cpu")) for mode in MODES}
    times: dict[str, list[float]] = {kind: [] for kind in ("none", "sync", *MODES)}
    try:
        for mode, saver in savers.items():  # the writer process starts once per run: not timed
            saver.save(os.path.join(folder, mode), 0, job.layers, job.opt, {"scaler": {}}, job="bench", keep_last=1)
            saver.wait("the rounds")
        steps = args.save_every + 1
        for r in range(args.rounds):
            for kind in times:
                only = {kind: savers[kind]} if kind in savers else {}
                times[kind].append(window(job, steps, kind, os.path.join(folder, kind), r + 1, only))
    finally:
        for saver in savers.values():
            saver.close()
        shutil.rmtree(folder, ignore_errors=True)
        dist.destroy_process_group()
    median = {kind: statistics.median(t) for kind, t in times.items()}
    write = median["sync"] - median["none"]
    lines = [f"state {job.state_bytes() / 1e6:.0f} MB ({args.layers} x Linear {args.width}, AdamW), windows of "
             f"{steps} steps, batch {args.batch}, 1 compute thread; medians of {args.rounds} rounds: no save "
             f"{median['none']:.2f} s, sync {median['sync']:.2f} s (the write: {write:.2f} s)", ""]
    for mode in MODES:
        hidden = 1.0 - (median[mode] - median["none"]) / write if write > 0 else float("nan")
        lines.append(f"- {mode}: hides {100 * hidden:.0f}% of the write (window {median[mode]:.2f} s)")
    report("train.checkpoint_mode: the write hidden from training", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
