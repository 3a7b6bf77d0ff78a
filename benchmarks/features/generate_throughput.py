"""Pipelined generation: tokens/s with several micro-batches in flight against one at a time.

`--ranks` processes (gloo, CPU) each hold one stage of a random built-in GPT and generate, with
a KV cache per stage (:mod:`pipeflow.runtime.decode`), `--new-tokens` tokens for `--prompts`
prompts of `--prompt-len` tokens grouped into micro-batches of `--batch-size`: once with every
micro-batch in flight (while the last stage samples micro-batch g, stage 0 already runs g + 1)
and once with one micro-batch at a time (the stages take turns).  Greedy, no end-of-sequence id,
so both make the same tokens; the best of `--repeats` runs of each (alternating) is reported.

    python benchmarks/features/generate_throughput.py --ranks 2 --prompts 8 --batch-size 2 --new-tokens 32
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_ranks  # noqa: E402


@gloo_worker(timeout=datetime.timedelta(seconds=300))
def worker(rank: int, ranks: int, port: int, args: argparse.Namespace, queue) -> None:
    """One stage: generate in both modes, rank 0 puts {mode: (seconds, tokens)} on the queue."""
    from pipeflow.models.gpt import build_gpt
    from pipeflow.models.gpt_decode import GPTStageDecoder
    from pipeflow.commands.generate import split
    from pipeflow.runtime.decode import Sampler, generate, left_padded
    from pipeflow.runtime.transport import P2PComm

    torch.set_num_threads(args.threads)
    context = args.prompt_len + args.new_tokens
    spec = build_gpt(vocab_size=args.vocab, block_size=context, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.width, seed=0)
    mine = split(len(spec.layers), ranks)[rank]
    layers = {i: layer.eval() for i, layer in zip(mine, spec.build_layers(mine, "cpu", torch.float32))}
    decoder = GPTStageDecoder(layers, len(spec.layers), context)
    comm = P2PComm(None, torch.device("cpu"))
    comm.warmup()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(args.vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    modes = {"all micro-batches in flight": 0, "one micro-batch at a time": 1}
    best = {mode: float("inf") for mode in modes}
    results = {}
    for _ in range(args.repeats):  # the modes alternate, so a busy spell of a shared machine hits both
        for mode, in_flight in modes.items():
            batches = [left_padded(prompts[k:k + args.batch_size], 0, args.new_tokens, context)
                       for k in range(0, len(prompts), args.batch_size)]
            dist.barrier()
            start = time.perf_counter()
            made = generate(decoder, batches, Sampler(), (), 0, comm, torch.float32, in_flight)
            dist.barrier()
            best[mode] = min(best[mode], time.perf_counter() - start)
            if made is not None:
                results[mode] = (best[mode], sum(len(row) for batch in made for row in batch))
    if rank == 0:
        queue.put(results)


def table(results: dict, args: argparse.Namespace) -> str:
    """A Markdown table: tokens/s per mode and the speed-up over one micro-batch at a time."""
    base = results["one micro-batch at a time"]
    lines = [f"{args.ranks} stages, GPT {args.layers} layers x {args.width} wide, {args.prompts} prompts of "
             f"{args.prompt_len} tokens in micro-batches of {args.batch_size}, {args.new_tokens} new tokens each",
             "", "| mode | seconds | tokens/s | vs one at a time |", "|---|---|---|---|"]
    for mode, (seconds, tokens) in results.items():
        lines.append(f"| {mode} | {seconds:.3f} | {tokens / seconds:.0f} | {base[0] / seconds:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    report("pipelined generation: micro-batches in flight vs one at a time", table(spawn_ranks(worker, args), args),
           args.out)


if __name__ == "__main__":
    main()
