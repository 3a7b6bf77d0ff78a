"""Measure what ``pipeline.checkpoint_activations`` saves: activation memory held by one stage.

One stage of a GPT (embedding, n blocks, head) runs the forward of m micro-batches, as a
pipeline stage does before its first backward (GPipe holds all m, 1F1B up to p), then their
backwards.  Each setting runs in a fresh process; the figure is the growth of the resident set
from before the forwards to after them (CPU, glibc told to return every large block to the OS),
or ``torch.cuda.max_memory_allocated`` growth on a GPU.  Run:

    python examples/activation_memory.py            # CPU
    python examples/activation_memory.py --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

SETTINGS = ("false", "2", "true")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measure(setting: str, device: str, args: argparse.Namespace) -> dict[str, float]:
    """Held activation memory (MB) and step time (ms) of one stage for one setting."""
    import torch

    from pipeflow.models.gpt import build_gpt
    from pipeflow.runtime.precision import checkpoint_every
    from pipeflow.runtime.stage import Stage

    torch.manual_seed(0)
    spec = build_gpt(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width)
    stage = Stage(0, 1, spec.build_all(device=device), spec.loss_fn, checkpoint_every=checkpoint_every(setting))
    batches = [torch.randint(256, (args.micro, args.seq), device=device) for _ in range(args.m)]

    def step(after_forwards: Callable[[], float] = lambda: 0.0) -> float:
        """Forward every micro-batch, call `after_forwards` and keep what it returns, then backward them."""
        for i, x in enumerate(batches):
            stage.forward(i, (x,), x, 1.0 / args.m)
        held = after_forwards()
        for i in range(args.m):
            stage.backward(i, None)
        return held

    step()  # warm-up: gradients allocated once, kept
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _rss_mb()
    t0 = time.perf_counter()
    held = step(lambda: (torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mb()) - before)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"held_mb": held, "step_ms": 1e3 * seconds}


def main() -> None:
    """Run every setting in its own process and print a table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8, help="micro-batch size")
    parser.add_argument("--m", type=int, default=4, help="micro-batches held before the first backward")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.device, args)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    print(f"GPT stage: {args.layers} blocks, width {args.width}, seq {args.seq}, micro-batch {args.micro}, "
          f"{args.m} micro-batches held, {args.device}")
    print("checkpoint_activations | held activations (MB) | step (ms)")
    for setting in SETTINGS:
        out = subprocess.run([sys.executable, __file__, "--one", setting, *sys.argv[1:]], env=env,
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{setting:>22} | {row['held_mb']:21.1f} | {row['step_ms']:9.0f}")


if __name__ == "__main__":
    main()
