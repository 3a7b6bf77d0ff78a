"""A link's rate as the start-of-run probe takes it, against plain streams on the same link.

    python benchmarks/predictions/link_rates.py --rate-mbit 100 --out benchmarks/RESULTS.md

Two emulated hosts (root and ``ip netns``; skipped with the reason where refused), one gloo rank
each, the link between them limited by a token bucket (``tbf``) to ``--rate-mbit``. Printed, per
``--rounds``: the probe every run uses (:func:`pipeflow.planning.links.probe_pair`: latency,
sustained rate, burst), then streams of each size sent one way, and both ways at once as a
pipeline's steady state sends them (activations forward, gradients back). The probe times its
rate one direction at a time (the simulator queues each direction on its own), so it should get
what a one-way stream gets.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.runner import benchmark_parser, report  # noqa: E402

SIZES = (1 << 19, 1 << 22, 1 << 24)
PORT = 29611


def worker(rank: int, master: str, rounds: int) -> None:
    """One host's rank: the probe, then the streams; rank 0 prints the figures."""
    import torch
    import torch.distributed as dist

    from pipeflow.planning.links import probe_pair, world_max
    from pipeflow.runtime.transport import P2PComm

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=60))
    comm = P2PComm(None, torch.device("cpu"))
    comm.warmup()
    peer = 1 - rank
    probes = [probe_pair(comm, peer, world_max(torch.device("cpu"))) for _ in range(rounds)]
    if rank == 0:
        print("probe (a stream each way): " + ", ".join(f"{1e-6 / per_byte if per_byte > 0 else float('inf'):.2f}"
                                    for _, per_byte, _ in probes) + " MB/s", flush=True)

    def stream(nbytes: int, both: bool) -> float:
        sent, got = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
        dist.barrier()
        start = time.perf_counter()
        if both:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, got, peer)]):
                work.wait()
        elif rank == 0:
            dist.send(sent, 1)
        else:
            dist.recv(got, 0)
        dist.barrier()
        return time.perf_counter() - start

    for nbytes in SIZES:
        rates = [nbytes / statistics.median(stream(nbytes, both) for _ in range(rounds)) / 1e6 for both in (False, True)]
        if rank == 0:
            print(f"| {nbytes >> 10} KB | {rates[0]:.2f} | {rates[1]:.2f} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=int, default=None, help=argparse_hidden())
    parser.add_argument("--master", default="", help=argparse_hidden())
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.master, args.rounds)
        return
    from examples.emulated_hosts import EmulatedHosts, unavailable

    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return
    with EmulatedHosts(2, names="missing") as hosts:
        hosts.limit(1, args.rate_mbit)
        argv = [sys.executable, os.path.abspath(__file__), "--rounds", str(args.rounds), "--master", hosts.addresses[0]]
        env = {"GLOO_SOCKET_IFNAME": "eth0"}  # the host's own link (its name may resolve to loopback)
        procs = [hosts.run(i, [*argv, "--worker", str(i)], env=env, timeout_s=300) for i in range(2)]
        outs = [p.communicate(timeout=320)[0] for p in procs]
    rows = [line for line in outs[0].splitlines() if line.startswith("| ")]
    probe = next((line for line in outs[0].splitlines() if line.startswith("probe (")), "")
    if any(p.returncode for p in procs) or not rows:
        print("\n".join(o[-2000:] for o in outs))
        raise SystemExit(1)
    text = "\n".join([f"2 emulated hosts x 1 gloo rank, tbf {args.rate_mbit:g} Mbit/s ({args.rate_mbit / 8:.2f} MB/s) "
                      f"on the link; medians of {args.rounds}; the start's {probe}", "",
                      "| message | one way (MB/s) | both ways, each (MB/s) |", "| --- | ---: | ---: |", *rows])
    report("A link's rate: the start probe against streams", text, args.out)


def argparse_hidden() -> str:
    """argparse's marker for an option --help does not list (the workers' own)."""
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
