"""pipeflow vs torch.distributed.pipelining, side by side in the same processes.

Both frameworks run the same layers (same weights), split into the same stages on the same
ranks, with the same schedule, batch and micro-batches, in one process group; their steps
alternate (pipeflow, torch, pipeflow, torch, ...) so that load on the machine hits both alike.
The table gives each one's median step time and the ratio pipeflow / torch: the median of the
per-round ratios with their interquartile range.

    torchrun --nproc-per-node 2 benchmarks/overhead/vs_torch_pipelining.py --hidden 512 64 --schedules gpipe 1f1b
    torchrun --nproc-per-node 4 benchmarks/overhead/vs_torch_pipelining.py --model gpt --hidden 128 \\
        --schedules gpipe 1f1b interleaved_1f1b zbv
    torchrun --nproc-per-node 4 benchmarks/overhead/vs_torch_pipelining.py --model sleep --schedules 1f1b zbv
    torchrun --nproc-per-node 4 benchmarks/overhead/vs_torch_pipelining.py --model sleep --microbatches 6 \\
        --schedules interleaved_1f1b interleaved_zb   # m not a multiple of p: torch's flexible rule

Models: ``mlp`` (Linear + GELU layers of width --hidden, --layers-per-stage per stage), ``gpt``
(pre-LN transformer blocks of width --hidden, sequences of --seq tokens), ``sleep`` (one sleep
layer per stage: F, B, W cost --sleep-ms each without using the CPU; the table then also gives
each framework's step over the simulator's makespan, for the nominal costs and for the costs one
sleep layer has when profiled alone, since ``time.sleep`` wakes late; the sleep input requires
grad in both frameworks, so stage 0 computes its input gradient in both, torch's split schedules
inside stage 0's W rather than its B: the same work in another slot than the simulated
makespan puts it).  Loss: mean square against a random
target.  gloo on CPU by default; ``--device cuda`` uses NCCL on cuda:LOCAL_RANK.  With
``--out FILE`` rank 0 appends the table to FILE with the command, machine, torch and date.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from pipeflow.runtime.transport import P2PComm  # noqa: E402
from benchmarks.runner import append_result, benchmark_parser, median_ratio, medians, microbatches, mse, slowest_seconds  # noqa: E402
from benchmarks.sleep_tools import shared_sleep_profile, sleep_costs  # noqa: E402
from pipeflow.models.gpt import Block, GPTConfig  # noqa: E402
from pipeflow.models.sleep import SleepLayer  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.runtime.posting import AheadTuner  # noqa: E402
from pipeflow.schedules import PipelineSchedule, build_schedule, simulate  # noqa: E402
from pipeflow.runtime.stage import Stage  # noqa: E402

TORCH_SCHEDULES = {  # pipeflow name -> torch.distributed.pipelining.schedules class name
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def make_layers(args: argparse.Namespace, hidden: int, stage: int) -> list[nn.Module]:
    """The layers of stage `stage`, seeded by stage so every framework and rank agrees."""
    torch.manual_seed(1000 + stage)
    if args.model == "sleep":
        return [SleepLayer(args.sleep_ms, args.sleep_ms, args.sleep_ms)]
    if args.model == "gpt":
        cfg = GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers_per_stage, n_head=4,
                        n_embd=hidden, dropout=0.0, bias=True)
        return [Block(cfg) for _ in range(args.layers_per_stage)]
    return [nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(args.layers_per_stage)]


def make_batch(args: argparse.Namespace, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (input, target) on every rank."""
    gen = torch.Generator().manual_seed(7)
    shape = (args.batch, args.seq, hidden) if args.model == "gpt" else (args.batch, 8 if args.model == "sleep" else hidden)
    x, y = torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device)
    # sleep-stages: the input requires grad so that stage 0's B costs B as every other stage's
    # does (its input gradient is computed, in both frameworks), as the simulator charges it
    return x.requires_grad_(args.model == "sleep"), y


class Runner:
    """One framework's step on this rank: ``step()`` runs it and returns the loss (last stage)."""

    def __init__(
        self, step: Callable[[], torch.Tensor | None], params: list[nn.Parameter], pipeline: Pipeline | None = None
    ) -> None:
        self._step, self.params, self.pipeline = step, params, pipeline

    def step(self) -> torch.Tensor | None:
        """One training step (forward and backward of every micro-batch), grads then cleared."""
        loss = self._step()
        for p in self.params:
            p.grad = None
        return loss


def pipeflow_runner(schedule: PipelineSchedule, layers: dict[int, list[nn.Module]], batch, device, m: int) -> Runner:
    """pipeflow's Pipeline over this rank's stages."""
    S = schedule.num_stages
    stages = {s: Stage(s, S, mods, mse) for s, mods in layers.items()}
    pipe = Pipeline(stages, schedule, P2PComm(None, device, timeout_s=300))
    x, y = batch

    def step() -> torch.Tensor | None:
        return pipe.run(*microbatches(x, y, m, stages, S))

    return Runner(step, [p for st in stages.values() for p in st.parameters()], pipe)


def floor_runner(pipe: Pipeline, batch, m: int, sleep_ms: float, post: Callable = dist.batch_isend_irecv,
                 wait: Callable = lambda work: work.wait()) -> Runner:
    """The floor any runtime can reach here: pipeflow's own lowered program for this rank (the
    posting option its tuner chose) run with nothing but plain ``dist.batch_isend_irecv`` calls
    (`post`) on fresh tensors, waits on their works (`wait`) and ``time.sleep`` for each action
    (F, B and W ``sleep_ms`` each, a full B both) -- no autograd, no stage, no inbox, no
    recording, no checks."""
    rows = batch[0].shape[0] // m
    wait_s = sleep_ms / 1e3

    def step() -> None:
        program = pipe.programs[pipe.posting.for_training(pipe._coalescing)]
        works: dict = {}
        for st in program:
            if st.ops:
                ops = [dist.P2POp(dist.isend if op.is_send else dist.irecv, torch.empty(rows, 8), op.peer)
                       for op in st.ops]
                done = post(ops)
                for op, w in zip(st.ops, done if len(done) == len(ops) else [done[0]] * len(ops)):
                    works[op] = w
            for op in st.waits:
                wait(works.pop(op))
            if st.action is not None:
                time.sleep(wait_s * (2 if st.action.kind == "B" and st.backward_weights else 1))
            for op in st.after:
                wait(works.pop(op))
        return None

    return Runner(step, [])


def layer_floor_runner(pipe: Pipeline, layers: dict[int, list[nn.Module]], batch, m: int) -> Runner:
    """The floor with the layers: pipeflow's own program (as :func:`floor_runner`) with plain
    ``batch_isend_irecv`` calls, each action running this rank's layers through autograd -- F
    forward, a full B ``backward`` to the input and the weights, a split B to the input alone and
    its W to the weights -- and nothing else: no Stage, no inbox checks, no recording, no shape
    plan.  What any runtime that trains these layers must do; beside :func:`floor_runner` it says
    how much of a step is the layers' own work around their sleeps."""
    schedule, me = pipe.schedule, pipe.comm.rank
    owner, last = schedule.stage_to_rank, schedule.num_stages - 1
    mods = {s: nn.Sequential(*ls) for s, ls in layers.items()}
    rows, inputs = batch[0].shape[0] // m, batch[0].chunk(m)

    def step() -> None:
        program = pipe.programs[pipe.posting.for_training(pipe._coalescing)]
        works, inbox, outbox, kept, pending = {}, {}, {}, {}, {}

        def deliver(payload: str, i: int, src: int, dst: int, t: torch.Tensor) -> None:
            if owner[dst] == me:
                inbox[payload, i, dst] = t
            else:
                outbox[payload, i, src] = t.contiguous()

        for st in program:
            if st.ops:
                tensors = [outbox.pop((op.payload, op.microbatch, op.src_stage)) if op.is_send else torch.empty(rows, 8)
                           for op in st.ops]
                done = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.is_send else dist.irecv, t, op.peer)
                                               for op, t in zip(st.ops, tensors)])
                for op, t, w in zip(st.ops, tensors, done if len(done) == len(st.ops) else [done[0]] * len(st.ops)):
                    works[op] = (w, t)
            for op in st.waits:
                w, t = works.pop(op)
                w.wait()
                if not op.is_send:
                    inbox[op.payload, op.microbatch, op.dst_stage] = t
            a = st.action
            if a is not None:
                s, i = a.stage, a.microbatch
                if a.kind == "F":
                    x = (inputs[i] if s == 0 else inbox.pop(("act", i, s))).detach().requires_grad_()
                    out = mods[s](x)
                    kept[s, i] = (x, out)
                    if s < last:
                        deliver("act", i, s, s + 1, out.detach())
                elif a.kind == "B":
                    x, out = kept.pop((s, i))
                    grad = torch.ones_like(out) if s == last else inbox.pop(("grad", i, s))
                    if st.backward_weights:
                        torch.autograd.backward(out, grad)
                        grad_in = x.grad
                    else:
                        (grad_in,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
                        pending[s, i] = (out, grad)
                    if s > 0:
                        deliver("grad", i, s, s - 1, grad_in)
                else:
                    out, grad = pending.pop((s, i))
                    torch.autograd.grad(out, list(mods[s].parameters()), grad)
            for op in st.after:
                works.pop(op)[0].wait()
        return None

    return Runner(step, [])


def torch_runner(name: str, schedule: PipelineSchedule, layers: dict[int, list[nn.Module]], batch, device, m: int) -> Runner:
    """torch.distributed.pipelining's PipelineStage(s) and schedule class for the same split."""
    from torch.distributed.pipelining import PipelineStage, schedules

    S = schedule.num_stages
    mods = {s: nn.Sequential(*ls) for s, ls in layers.items()}
    stages = [PipelineStage(mods[s], s, S, device) for s in sorted(mods)]
    cls = getattr(schedules, TORCH_SCHEDULES[name])
    sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=mse)
    x, y = batch

    def step() -> torch.Tensor | None:
        args = (x,) if 0 in mods else ()
        if S - 1 in mods:
            losses: list[torch.Tensor] = []
            sched.step(*args, target=y, losses=losses)
            return torch.stack(losses).mean()
        sched.step(*args)
        return None

    return Runner(step, [p for mod in mods.values() for p in mod.parameters()])


def timed(runner: Runner, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """(slowest rank's seconds, loss) of one step, all ranks starting together.

    On CUDA the GPU is drained before the clock starts and again before it stops (a step's
    host code returns once its kernels are queued), and the time travels in a tensor on the
    GPU (NCCL reduces only CUDA tensors)."""
    return slowest_seconds(runner.step, device)


def compare(name: str, hidden: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Alternate the two frameworks' steps; medians, the ratio and its spread, loss agreement."""
    p, m, rank = dist.get_world_size(), args.microbatches, dist.get_rank()
    schedule = build_schedule(name, p, m)
    mine = schedule.stages_of(rank)
    built = {s: make_layers(args, hidden, s) for s in mine}
    for mods in built.values():
        for mod in mods:
            mod.to(device)
    batch = make_batch(args, hidden, device)
    runners = {
        "pipeflow": pipeflow_runner(schedule, built, batch, device, m),
        "torch": torch_runner(name, schedule, {s: copy.deepcopy(ls) for s, ls in built.items()}, batch, device, m),
    }
    if args.model == "sleep" and device.type == "cpu":  # the hand-written floor, in the same rounds
        runners["floor"] = floor_runner(runners["pipeflow"].pipeline, batch, m, args.sleep_ms)
    times: dict[str, list[float]] = {fw: [] for fw in runners}
    losses: dict[str, torch.Tensor | None] = {}
    for k in range(args.warmup + args.rounds):
        for fw, runner in runners.items():
            took, loss = timed(runner, device)
            if k == 0:
                losses[fw] = loss
            if k >= args.warmup:
                times[fw].append(took)
    ratios = [a / b for a, b in zip(times["pipeflow"], times["torch"])]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    diff = float("nan")
    if losses.get("pipeflow") is not None and losses.get("torch") is not None:
        a, b = float(losses["pipeflow"].detach()), float(losses["torch"].detach())
        diff = abs(a - b) / max(abs(b), 1e-30)
    gathered: list[float] = [0.0] * p
    dist.all_gather_object(gathered, diff)
    row = {
        "model": args.model, "hidden": hidden, "p": p, "schedule": name,
        **medians({fw: times[fw] for fw in ("pipeflow", "torch")}),
        "ratio": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
        "loss_diff": max((d for d in gathered if d == d), default=float("nan")),
        "recvs": {True: "ahead", False: "at step", None: "-"}[runners["pipeflow"].pipeline.posting.tuner.choice],
    }
    if "floor" in times:
        row["floor"] = statistics.median(times["floor"])
        row["over_floor"] = median_ratio(times["pipeflow"], times["floor"])
        row["torch_over_floor"] = median_ratio(times["torch"], times["floor"])
    if args.model == "sleep":
        costs = {"F": args.sleep_ms / 1e3, "B": args.sleep_ms / 1e3, "W": args.sleep_ms / 1e3}
        row["makespan"] = simulate(schedule, costs=costs).makespan
        row["profiled_makespan"] = simulate(schedule, costs=sleep_costs(schedule, args.sleep_profile)).makespan
    return row


def table(rows: list[dict], args: argparse.Namespace) -> str:
    """The results as a Markdown table."""
    sleep = args.model == "sleep"
    head = ("| model | width | ranks | schedule | pipeflow step (ms) | torch step (ms) | pipeflow / torch (median) "
            "| IQR of the ratio | loss rel. diff | pipeflow recvs (comm.post_recvs=auto) |")
    floor = sleep and "floor" in rows[0]
    if sleep:
        head += (" simulated makespan (ms) | pipeflow / makespan | torch / makespan "
                 "| makespan, profiled costs (ms) | pipeflow / that | torch / that |")
    if floor:
        head += " floor step (ms) | pipeflow / floor | torch / floor |"
    lines = [
        f"batch {args.batch}, {args.microbatches} micro-batches, {args.rounds} alternating rounds "
        f"after {args.warmup} warm-up, {args.layers_per_stage if not sleep else 1} layer(s) per stage",
        "",
        head,
        "|" + " --- |" * (head.count("|") - 1),
    ]
    for r in rows:
        line = (
            f"| {r['model']} | {r['hidden'] if not sleep else '-'} | {r['p']} | {r['schedule']} | {r['pipeflow'] * 1e3:.1f} "
            f"| {r['torch'] * 1e3:.1f} | {r['ratio']:.3f} | {r['q1']:.3f}-{r['q3']:.3f} | {r['loss_diff']:.1e} | {r['recvs']} |"
        )
        if sleep:
            for key in ("makespan", "profiled_makespan"):
                line += f" {r[key] * 1e3:.1f} | {r['pipeflow'] / r[key]:.3f} | {r['torch'] / r[key]:.3f} |"
        if floor:
            line += f" {r['floor'] * 1e3:.1f} | {r['over_floor']:.3f} | {r['torch_over_floor']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--model", choices=("mlp", "gpt", "sleep"), default="mlp")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 64])
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (gpt)")
    parser.add_argument("--sleep-ms", type=float, default=10.0, help="F = B = W cost (sleep)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=AheadTuner().steps_to_decide,
                        help="untimed rounds first (default: until comm.post_recvs=auto has chosen)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.model == "sleep":
        args.hidden = args.hidden[:1]
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10),
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        P2PComm(None, device).warmup()
        if args.model == "sleep":  # what one sleep layer really costs, measured on rank 0 alone
            args.sleep_profile = shared_sleep_profile(args.sleep_ms, args.sleep_ms, args.sleep_ms)
        rows = []
        for hidden in args.hidden:
            for name in args.schedules:
                row = compare(name, hidden, args, device)
                rows.append(row)
                if dist.get_rank() == 0:
                    print(f"{name} width {hidden}: ratio {row['ratio']:.3f}", file=sys.stderr, flush=True)
        if dist.get_rank() == 0:
            text = table(rows, args)
            print(text)
            if args.out:
                write(text, args, backend)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write(text: str, args: argparse.Namespace, backend: str) -> None:
    """Append the table to args.out with how it was made."""
    append_result(
        args.out, f"pipeflow vs torch.distributed.pipelining, {args.model}",
        f"torchrun --nproc-per-node {dist.get_world_size()} {' '.join(sys.argv)}", text, backend,
        torch.cuda.get_device_name() if args.device == "cuda" else "",
    )


if __name__ == "__main__":
    main()
