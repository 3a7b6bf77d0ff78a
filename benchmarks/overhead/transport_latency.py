"""The floor under every pipeline hand-off on this machine: raw gloo ping-pong latency.

No pipeflow code runs here: two processes exchange a small tensor through
``dist.batch_isend_irecv`` (one send and one recv per call, as a pipeline step posts them),
after a short pause that stands for a stage's compute, and the time from posting to holding the
peer's tensor is recorded.  Two postings are measured side by side in one run:

* ``at its step``: the recv is posted with the send and waited on at once (rendezvous);
* ``a step ahead``: the recv for the next exchange is posted with this send, before the pause
  (what pipeflow does on gloo).

The table gives the median, the 90th and 99th percentiles and the share of exchanges slower
than 2 ms: on a small shared VM a few per cent of hand-offs stall for a scheduler slice (2-5 ms)
inside gloo's socket calls, whichever framework posts them, and those stalls, not Python,
decide the step time of small models (see docs/explanation/performance.md, "The runtime against the simulated ideal").

    python benchmarks/overhead/transport_latency.py --exchanges 2000
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_ranks  # noqa: E402

MODES = ("at its step", "a step ahead")


def exchange_times(mode: str, args: argparse.Namespace) -> list[float]:
    """Seconds from posting to holding the peer's tensor, for each of `args.exchanges`."""
    peer = 1 - dist.get_rank()
    out = torch.randn(args.numel)
    buffers = [torch.empty(args.numel) for _ in range(2)]
    times = []
    dist.barrier()
    pending = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffers[0], peer)]) if mode == MODES[1] else []
    for k in range(args.exchanges):
        time.sleep(args.pause_us / 1e6)
        start = time.perf_counter()
        if mode == MODES[1]:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, buffers[(k + 1) % 2], peer)])
            for work in pending:
                work.wait()
            pending, sent = works[1:], works[:1]
        else:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, buffers[0], peer)])
            works[1].wait()
            sent = works[:1]
        times.append(time.perf_counter() - start)
        for work in sent:
            work.wait()
    if pending:  # the recv posted for an exchange that never comes: send it its tensor
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer)]) + pending:
            work.wait()
    return times


@gloo_worker()
def worker(rank: int, p: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    rows: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):  # alternate the modes so load hits both alike
        for mode in MODES:
            rows[mode] += exchange_times(mode, args)
    if rank == 0:
        queue.put(rows)


def table(rows: dict[str, list[float]], args: argparse.Namespace) -> str:
    """The latency distribution of each mode as a Markdown table."""
    lines = [
        f"2 processes, gloo on loopback, {args.numel} float32 per message, {args.pause_us} µs pause "
        f"between exchanges, {args.repeats} × {args.exchanges} exchanges per mode (alternating)",
        "",
        "| recv posted | median (µs) | p90 (µs) | p99 (µs) | exchanges over 2 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, times in rows.items():
        q = statistics.quantiles(times, n=100)
        slow = sum(t > 2e-3 for t in times) / len(times)
        lines.append(f"| {mode} | {statistics.median(times) * 1e6:.0f} | {q[89] * 1e6:.0f} | {q[98] * 1e6:.0f} | {slow:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--exchanges", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--pause-us", type=float, default=100.0)
    args = parser.parse_args()
    args.ranks = 2
    report("gloo transport latency (raw torch, no pipeflow)", table(spawn_ranks(worker, args), args), args.out)


if __name__ == "__main__":
    main()
