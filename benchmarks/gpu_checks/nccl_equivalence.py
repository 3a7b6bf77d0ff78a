"""Pipelined training on NCCL equals the unsplit model (float32, TF32 off), every schedule.

    torchrun --nproc-per-node 2 benchmarks/gpu_checks/nccl_equivalence.py
    torchrun --nproc-per-node 4 benchmarks/gpu_checks/nccl_equivalence.py --schedules gpipe 1f1b zbv

Each rank builds its stages on cuda:LOCAL_RANK and, with the same seeds, the whole model as the
reference; one step of each schedule must give the reference's loss (last stage) and the
reference's gradients of this rank's layers to a relative 1e-5.  Prints one line per schedule
(``PASS``/``FAIL``) on rank 0 and exits non-zero on any failure.
"""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from pipeflow.runtime.transport import P2PComm  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.schedules import build_schedule  # noqa: E402
from pipeflow.runtime.stage import Stage  # noqa: E402
from benchmarks.runner import benchmark_parser, microbatches, mse  # noqa: E402


def layer(index: int, hidden: int, device: torch.device) -> nn.Module:
    """Layer `index` of the model, seeded by its index."""
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()).to(device)


def one(name: str, m: int, hidden: int, device: torch.device) -> tuple[float, float]:
    """(loss rel. diff or 0 off the last stage, worst grad rel. diff) of one step of `name`."""
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule(name, p, m)
    S, per = schedule.num_stages, 2
    stages = {s: Stage(s, S, [layer(s * per + j, hidden, device) for j in range(per)], mse) for s in schedule.stages_of(rank)}
    pipe = Pipeline(stages, schedule, P2PComm(None, device, timeout_s=120))
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8 * m, hidden, generator=gen).to(device), torch.randn(8 * m, hidden, generator=gen).to(device)
    loss = pipe.run(*microbatches(x, y, m, stages, S))
    model = nn.Sequential(*[layer(k, hidden, device) for k in range(S * per)])
    ref = mse(model(x), y)
    ref.backward()
    worst = 0.0
    for s, stage in stages.items():
        for j, mod in enumerate(stage.module):
            for got, want in zip(mod.parameters(), model[s * per + j].parameters()):
                worst = max(worst, float((got.grad - want.grad).norm() / want.grad.norm()))
    loss_diff = 0.0 if loss is None else abs(float(loss) - float(ref.detach())) / abs(float(ref.detach()))
    return loss_diff, worst


def main() -> None:
    parser = benchmark_parser(__file__, __doc__, out=False)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a gloo dry run")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    failed = 0
    try:
        P2PComm(None, device).warmup()
        for name in args.schedules:
            loss_diff, worst = one(name, args.microbatches, args.hidden, device)
            both = torch.tensor([loss_diff, worst], device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            ok = float(both[0]) <= 1e-5 and float(both[1]) <= 1e-5
            failed += not ok
            if dist.get_rank() == 0:
                print(f"{'PASS' if ok else 'FAIL'} {dist.get_backend()} equivalence {name} p={dist.get_world_size()} "
                      f"m={args.microbatches}: loss rel. diff {float(both[0]):.1e}, worst grad rel. diff {float(both[1]):.1e}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
