"""Activation offload on one rank: pipeline.offload=none|auto|all side by side, step time and peak
memory against the start-of-run prediction (issue 33's benchmark).

    python benchmarks/features/offload.py                  # CPU: GPT 4 x 256, seq 128, batch 16, m 8, fp32: none vs all
    python benchmarks/features/offload.py --device cuda    # GPU: GPT 12 x 1024, 16 heads, seq 1024, batch 16, m 8, bf16
    python benchmarks/features/offload.py --case n_layer=2 n_embd=32 seq=16 batch=8 m=4 --rounds 1 --steps 1

One process, one process group of size 1 (gloo on the CPU, NCCL on CUDA), ``schedule=gpipe`` on
one rank: GPipe holds all m micro-batches' activations until their backwards, so its gaps are
real on one device.  Each mode is the Hydra config composed from ``configs/`` (as
``vs_plain_loop.py`` composes it: TensorBoard, evaluation, the progress bar and the memory steps
off, ``pipeline.profile=true`` since the prediction needs the profile) with
``pipeline.offload=<mode>``, built by ``pipeflow.run.builder.build_run``.  On CUDA the script first
measures the host link (``pipeflow.runtime.host_link.measure_link``: pinned memory, a side stream)
and prints it; ``auto`` offloads the groups whose copies the simulated gaps hide on that link.
On the CPU the copies are synchronous memcpys on the compute thread (no copy engine): ``auto``
plans nothing there, so the CPU default compares none with all, and shows memory, not hidden time.

Correctness first: every mode's first step (same seed, same weights, same batch) must give the
first mode's loss (rtol 1e-5 in fp32, 1e-3 under bf16/fp16, ``--rtol``); a disagreement exits 1.
Then ``--rounds`` rounds of warm-up steps and ``--steps`` timed steps in one block (the device
synchronised only at the block's edges; per-step time = block / steps; the median over rounds).
On the CPU all modes' trainers live at once and the rounds alternate between them; on CUDA one
trainer lives at a time (built, measured, closed, ``empty_cache``), so the allocator's peaks do
not mix.  Then one more step measured by the trainer's ``MemoryAccountant`` (sampled after every
action: the in-step peak of tracked tensor bytes) and the bytes that step offloaded.

Printed per mode: the (stage, micro-batch) groups planned of all, the step beside the predicted
step (``layout.prediction.step_s``; % = predicted / measured), the peak beside the predicted peak
(``prediction.memory[0].peak.total``), the bytes offloaded per step measured
(``pipeline.offloaded.bytes``) and predicted (``prediction.offloaded_bytes[0]``), and the step and
peak against none's measured in this run.  The peak is the accountant's tensor peak on the CPU; on
CUDA it is the allocator's steady-step peak (``reset_peak_memory_stats`` after the warm-up,
``max_memory_allocated`` after the timed block, the largest over rounds), with the tensor peak
beside it.  The prediction is of tracked tensor bytes (parameters, gradients, optimizer state,
activations, comm buffers), so the allocator's peak is above it by the CUDA workspace, the
autocast copies of the weights and fragmentation; the within-10% target compares the tensor peak.
A last line says which targets hold: auto's step <= 1.05x none's; measured step and peak within
10% of the prediction; the peak cut of auto and of all against none.  Targets do not set the exit
status (only the correctness check does).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner
from benchmarks.overhead.vs_plain_loop import PipeflowSteps, compose, start_one_rank, sync, timed_block  # noqa: E402

CASE_KEYS = ("n_layer", "n_embd", "n_head", "seq", "batch", "m")
DEFAULT_CASE = {"cpu": {"n_layer": 4, "n_embd": 256, "n_head": 4, "seq": 128, "batch": 16, "m": 8},
                # GPipe holding all 16 x 1024 tokens' activations (~1 MB a token in bf16): ~17 GB, some 20 GB peak
                "cuda": {"n_layer": 12, "n_embd": 1024, "n_head": 16, "seq": 1024, "batch": 16, "m": 8}}
DEFAULT_MODES = {"cpu": "none,all", "cuda": "none,auto,all"}
DEFAULT_RUNS = {"cpu": (1, 5), "cuda": (2, 4)}  # (warm-up steps, timed steps) per round
DEFAULT_ROUNDS = {"cpu": 5, "cuda": 3}
MODES = ("none", "auto", "all")
MIB = 2**20


@dataclass
class Measured:
    """One mode's figures."""

    mode: str
    planned: int = 0
    total: int = 0
    times: list[float] = field(default_factory=list)
    allocator: list[float] = field(default_factory=list)
    tensor_peak: float = math.nan
    offloaded: float = 0.0
    predicted_step: float = math.nan
    predicted_peak: float = math.nan
    predicted_offloaded: float = 0.0

    @property
    def step(self) -> float:
        return statistics.median(self.times)

    @property
    def peak(self) -> float:
        """The peak compared between modes: the allocator's on CUDA, else the tensor peak."""
        return max(self.allocator) if self.allocator else self.tensor_peak


def parse_case(device: str, spec: list[str] | None) -> dict[str, int]:
    """The device's default case with ``--case key=value ...`` applied."""
    case = dict(DEFAULT_CASE[device])
    for item in spec or []:
        key, sep, value = item.partition("=")
        if not sep or key not in CASE_KEYS or not value.isdigit():
            raise SystemExit(f"--case {item!r}: expected key=value with key one of {', '.join(CASE_KEYS)}, an integer")
        case[key] = int(value)
    if case["m"] < 1 or case["batch"] % case["m"]:
        raise SystemExit(f"--case batch={case['batch']} m={case['m']}: m must divide the batch")
    return case


def mib(nbytes: float) -> str:
    value = nbytes / MIB
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def pct(predicted: float, measured: float) -> str:
    return f"{100 * predicted / measured:.0f}%" if measured > 0 and math.isfinite(predicted) else "n/a"


def build(mode: str, base: list[str], device: torch.device, run_root: str) -> Any:
    from pipeflow.run.builder import build_run

    run_dir = tempfile.mkdtemp(prefix=f"run_{mode}_", dir=run_root)
    return build_run(compose([*base, f"pipeline.offload={mode}", f"train.run_dir={run_dir}"]), device)


def tensor_step(trainer: Any, step: int) -> tuple[float, float]:
    """One step measured by the trainer's MemoryAccountant: (in-step tensor peak, bytes offloaded)."""
    memory = trainer.loop.memory
    memory.begin()
    trainer.forward_backward(step, memory)
    if hasattr(trainer.loop.update.optimizer, "found_inf"):  # a deferred step's flag (as Trainer.apply drops it)
        del trainer.loop.update.optimizer.found_inf
    trainer.loop.update.optimizer.step()
    measured = memory.end(trainer.loop.pipeline.comm_tensors())  # after the update, before the grads go
    trainer.loop.update.optimizer.zero_grad(set_to_none=True)
    moved = trainer.loop.pipeline.offloaded
    return measured.peak.total, float(moved.bytes) if moved is not None else 0.0


def run_modes(modes: list[str], base: list[str], args: argparse.Namespace, device: torch.device, run_root: str,
              rtol: float) -> tuple[bool, dict[str, Measured]]:
    """Check, time and measure every mode (module docstring); returns (the check passed, figures).
    On the CPU all modes live at once (alternating rounds); on CUDA one at a time, each freed
    (``empty_cache``) before the next is built."""
    results: dict[str, Measured] = {}
    reference: list[tuple[str, float]] = []  # the first mode's first-step loss
    for batch in [modes] if device.type == "cpu" else [[mode] for mode in modes]:
        ok = run_batch(batch, base, args, device, run_root, rtol, results, reference)
        gc.collect()  # the batch's trainers went with run_batch's frame
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not ok:
            return False, results
    return True, results


def run_batch(batch: list[str], base: list[str], args: argparse.Namespace, device: torch.device, run_root: str,
              rtol: float, results: dict[str, Measured], reference: list[tuple[str, float]]) -> bool:
    """Build the trainers of `batch` (modes alive at once), check each one's first step against
    `reference`, then the timed rounds and the measured step; fills `results`; False on a disagreement."""
    warmup = args.warmup if args.warmup is not None else DEFAULT_RUNS[device.type][0]
    steps = args.steps if args.steps is not None else DEFAULT_RUNS[device.type][1]
    trainers = {mode: build(mode, base, device, run_root) for mode in batch}
    try:
        for mode, trainer in trainers.items():
            loss, _ = trainer.train_step(0)
            if not reference:
                reference.append((mode, loss))
            first, want = reference[0]
            diff = abs(loss - want) / max(abs(want), 1e-30)
            ok = diff <= rtol
            print(f"check: offload={mode} first-step loss {loss:.6f} vs offload={first} {want:.6f} "
                  f"(rel diff {diff:.1e}, rtol {rtol:g}): {'ok' if ok else 'DISAGREE'}", flush=True)
            if not ok:
                return False
            layout, prediction = trainer.plan.layout, trainer.plan.layout.prediction
            results[mode] = Measured(
                mode, len(layout.offload.reloads), trainer.plan.schedule.num_stages * trainer.plan.schedule.num_microbatches,
                predicted_step=prediction.step_s,
                predicted_peak=prediction.memory[0].peak.total if prediction.memory else math.nan,
                predicted_offloaded=prediction.offloaded_bytes[0] if prediction.offloaded_bytes else 0.0)
        drivers = {mode: PipeflowSteps(trainer, "steady") for mode, trainer in trainers.items()}
        next_step = dict.fromkeys(trainers, 1)
        for _ in range(args.rounds):
            for mode, driver in drivers.items():  # alternating where several live
                per_step, peak, next_step[mode] = timed_block(driver.step, next_step[mode], warmup, steps, device,
                                                              driver.drain)
                results[mode].times.append(per_step)
                if peak is not None:
                    results[mode].allocator.append(float(peak))
        for mode, trainer in trainers.items():
            results[mode].tensor_peak, results[mode].offloaded = tensor_step(trainer, next_step[mode])
            sync(device)
        return True
    finally:
        for trainer in trainers.values():
            trainer.close()


def mode_line(label: str, r: Measured, none: Measured | None, cuda: bool) -> str:
    line = (f"{label} | offload={r.mode} | groups {r.planned}/{r.total} | step {1e3 * r.step:.1f} ms "
            f"(predicted {1e3 * r.predicted_step:.1f} ms, {pct(r.predicted_step, r.step)}) | peak "
            f"{mib(r.peak)} MiB (predicted {mib(r.predicted_peak)} MiB, {pct(r.predicted_peak, r.peak)})")
    if cuda:
        line += f" | tensor peak {mib(r.tensor_peak)} MiB ({pct(r.predicted_peak, r.tensor_peak)})"
    line += f" | offloaded {mib(r.offloaded)} MiB/step (predicted {mib(r.predicted_offloaded)})"
    if none is not None:
        line += f" | vs none: step {r.step / none.step:.2f}x, peak {r.peak / none.peak:.2f}x"
    return line


def within(results: dict[str, Measured], predicted: str, measured: str) -> str:
    """Each mode's predicted / measured (%) and whether all are within 10% of 100%."""
    pcts = {m: 100 * getattr(r, predicted) / getattr(r, measured) for m, r in results.items()}
    holds = all(math.isfinite(p) and abs(p - 100) <= 10 for p in pcts.values())
    return ", ".join(f"{m} {p:.1f}%" for m, p in pcts.items()) + f" ({'holds' if holds else 'does not hold'})"


def summary_line(results: dict[str, Measured], cuda: bool) -> str:
    none = results.get("none")
    parts = []
    if "auto" in results and none is not None:
        ratio = results["auto"].step / none.step
        parts.append(f"auto step {ratio:.3f}x none's (target <= 1.05x: {'holds' if ratio <= 1.05 else 'does not hold'})")
    else:
        parts.append("auto step vs none: not run")
    parts.append("step within 10% of predicted: " + within(results, "predicted_step", "step"))
    parts.append(f"{'tensor ' if cuda else ''}peak within 10% of predicted: "
                 + within(results, "predicted_peak", "tensor_peak"))
    if none is not None:
        cuts = [f"{m} {100 * (1 - r.peak / none.peak):.0f}% ({r.peak / none.peak:.2f}x)"
                for m, r in results.items() if m != "none"]
        parts.append(f"{'allocator ' if cuda else ''}peak cut vs none: " + (", ".join(cuts) or "no other mode"))
    return "targets: " + " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/features/offload.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    parser.add_argument("--case", nargs="+", metavar="KEY=VALUE",
                        help=f"override the device's default case ({', '.join(CASE_KEYS)})")
    parser.add_argument("--modes", default=None,
                        help="comma list of pipeline.offload modes (default: none,all on cpu; none,auto,all on cuda)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per mode (default: 5 cpu, 3 cuda)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default: 5 cpu, 4 cuda)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before each round's timed block (default: 1 cpu, 2 cuda)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="train.precision (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance of the first-step loss check (default 1e-5 fp32, 1e-3 otherwise)")
    parser.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE", help="more Hydra overrides")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="also append the lines to FILE (markdown, e.g. benchmarks/RESULTS.md)")
    parser.add_argument("--verbose", action="store_true", help="also print each round's step times")
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else DEFAULT_ROUNDS[args.device]
    if args.rounds < 1 or (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    modes = (args.modes or DEFAULT_MODES[args.device]).split(",")
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes {args.modes!r}: a comma list of distinct modes from {', '.join(MODES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    case = parse_case(args.device, args.case)
    device = start_one_rank(args.device, args.threads)
    cuda = device.type == "cuda"
    precision = args.precision or ("bf16" if cuda else "fp32")
    rtol = args.rtol if args.rtol is not None else (1e-5 if precision == "fp32" else 1e-3)
    from pipeflow.runtime.host_link import measure_link

    name = torch.cuda.get_device_name(device) if cuda else f"{os.cpu_count()} CPU cores"
    link = measure_link(device)
    how = "pinned, side stream" if cuda else "memcpy on the compute thread"
    lines = [f"host link ({how}): {link.d2h_bytes_per_s / 1e9:.1f} GB/s to the host, "
             f"{link.h2d_bytes_per_s / 1e9:.1f} GB/s back, {'overlapped' if link.overlapped else 'not overlapped'}"]
    print(f"pipeline.offload: {name}, torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; modes {', '.join(modes)}; {args.rounds} rounds, medians over rounds", flush=True)
    print(lines[0], flush=True)
    base = [f"model.n_layer={case['n_layer']}", f"model.n_embd={case['n_embd']}", f"model.n_head={case['n_head']}",
            f"data.seq_len={case['seq']}", f"data.batch_size={case['batch']}", f"pipeline.num_microbatches={case['m']}",
            "schedule=gpipe", "parallel.pp=1", f"train.precision={precision}", f"dist.device={device}",
            "metrics.tensorboard=false", "metrics.progress_bar=false", "metrics.memory_steps=[]",
            "train.eval_every=0", "train.eval_batches=0", "pipeline.profile=true", *args.override]
    label = (f"GPT {case['n_layer']}x{case['n_embd']} h{case['n_head']}, seq {case['seq']}, batch {case['batch']}, "
             f"m {case['m']}, gpipe, {precision}, {device.type}")
    try:
        with tempfile.TemporaryDirectory(prefix="pipeflow_offload_") as run_root:
            ok, results = run_modes(modes, base, args, device, run_root, rtol)
    finally:
        dist.destroy_process_group()
    if ok:
        for r in results.values():
            lines.append(mode_line(label, r, results.get("none"), cuda))
            print(lines[-1], flush=True)
            if args.verbose:
                print(f"  rounds (ms per step): {[round(1e3 * t, 1) for t in r.times]}", flush=True)
        lines.append(summary_line(results, cuda))
        print(lines[-1], flush=True)
    if args.out:
        from benchmarks.runner import append_result

        append_result(args.out, "Activation offload (pipeline.offload), one rank", f"python {' '.join(sys.argv)}",
                      "\n".join(f"    {line}" for line in lines), backend="nccl" if cuda else "gloo",
                      device_name=name if cuda else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
