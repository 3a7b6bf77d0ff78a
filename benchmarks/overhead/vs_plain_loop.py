"""pipeflow on one rank against the plain PyTorch loop over the same layers (issue 29's benchmark).

    python benchmarks/overhead/vs_plain_loop.py                    # CPU: GPT 6 x 256, seq 256, batch 16, m = 4 and 16
    python benchmarks/overhead/vs_plain_loop.py --device cuda      # GPU: GPT 12 x 1024, 16 heads, seq 512, batch 64, bf16
    python benchmarks/overhead/vs_plain_loop.py --case n_layer=2 n_embd=32 seq=16 batch=4 m=2 --rounds 1 --steps 1
    python benchmarks/overhead/vs_plain_loop.py --compile          # train.compile: eager vs compiled, and zb_h1 vs 1f1b

Both run in this one process, on one process group of size 1 (gloo on the CPU, NCCL on CUDA):

- **pipeflow**: the Hydra config composed from ``configs/`` with the case's overrides (one
  stage, 1F1B; TensorBoard, evaluation, the progress bar and the memory steps off; layer
  profiling kept, since the start-of-run prediction needs it), built by
  ``pipeflow.run.builder.build_run`` as ``train.py`` builds it; each timed step is the one
  ``Trainer.fit`` runs (``Trainer.advance``: its loss and norm read back a step late where the
  trainer allows it, i.e. with fused AdamW and no fp16 loss scaler; the block's last pending
  step read back before the block ends), or with ``--pipeflow-step train_step`` the public
  ``Trainer.train_step(step)`` (read back within the step).  The correctness check uses
  ``Trainer.train_step``.
- **plain**: ``build_gpt(...)`` with the config's model keys (the same seed, so the same
  weights), ``.build_all(device=...)``; per micro-batch: forward under autocast (the config's
  ``train.precision``: bf16 on CUDA, none on the CPU unless ``--precision``),
  ``cross_entropy(logits.float(), y) / m``, ``backward()``; then ``clip_grad_norm_(params,
  optim.grad_clip)``, ``AdamW.step()`` with pipeflow's optimizer's own settings (lr schedule,
  betas, weight decay, eps, fused or not), ``zero_grad(set_to_none=True)``; no read-back.

Both take batch `step` from the same source (``trainer.plan.batches.train.get(step)``), split into m
micro-batches by the same ``split_microbatches``.  Before timing, each case checks correctness:
the first step's loss and grad norm (from identical weights, which are compared first) must agree
(rtol 1e-5 in float32, 1e-3 under bf16/fp16, ``--rtol``); a disagreement exits 1.

Then alternating rounds (pipeflow, plain, pipeflow, plain, ...; ``--rounds``): in each, warm-up
steps, then ``--steps`` timed steps in one block, the device synchronised only at the block's
edges (per-step time = block / steps).  On CUDA also the steady-step allocator peak of each:
``torch.cuda.reset_peak_memory_stats()`` after the warm-up, ``max_memory_allocated()`` after
the timed steps, less what the *other* one holds between steps (both live in this process: the
plain loop holds exactly its parameters and AdamW state, counted tensor by tensor; pipeflow
holds the rest of what is allocated between steps), so each peak is what it would be alone.

Printed per case: ``<case> | plain <ms> ms | pipeflow <ms> ms | step ratio <x>`` (medians over
rounds; ratio pipeflow / plain), on CUDA ``| peak plain <MiB> / pipeflow <MiB> MiB | peak ratio
<y>`` (the largest over rounds), and ``| predicted <ms> ms (<pct>% of measured)``: pipeflow's
start-of-run predicted step (``trainer.plan.layout.prediction.step_s``, what ``train.py`` logs as
"predicted step") against its measured median.

With ``--compile`` (issue 31) each case runs four steps side by side in alternating rounds, each
checked first against the compiled plain loop's first step (rtol 1e-4 in float32: compiled
kernels round differently): pipeflow eager (1F1B), pipeflow with ``train.compile=true`` (1F1B),
the plain loop with every layer compiled (``layer.compile(fullgraph=True)``, as a user would),
and pipeflow compiled with ``schedule=zb_h1`` (one rank, one stage: the same work as 1F1B when
the compiled backward's weight half is not repeated).  Printed: ``compiled/eager`` (pipeflow
eager / compiled: the speed-up), ``vs compiled plain`` (compiled pipeflow / compiled plain) and
``zb_h1/1f1b`` (both compiled), and on CUDA each one's steady-step allocator peak (the peak of
its timed block less what the others hold between steps: their parameters and AdamW state).
``--repeat-backward`` adds compiled zb_h1 whose B and W each run the whole compiled backward
(torch's own backend, what pipeflow's split avoids) and prints ``repeated/split zb_h1``.

On CUDA each case ends with ``| sync check: ...``: pipeflow's steady steps run once more under
``torch.cuda.set_sync_debug_mode("error")`` (any host-device sync raises, naming the call),
allowed only inside the one documented read-back per step (the previous step's figures,
``PendingStep.values``), which is counted.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeflow.data import split_microbatches  # noqa: E402
from pipeflow.models.gpt import build_gpt  # noqa: E402
from pipeflow.models.spec import run_layers  # noqa: E402
from pipeflow.run.trainer import Trainer, lr_at, unique_parameters  # noqa: E402
from pipeflow.runtime.compile import graphs_compiled  # noqa: E402
from pipeflow.runtime.precision import compute_dtype  # noqa: E402
from pipeflow.runtime.parallel.zero import local_optimizer  # noqa: E402

CASE_KEYS = ("n_layer", "n_embd", "n_head", "seq", "batch", "m")
DEFAULT_CASES = {  # the cases: m is a list, one case per value
    "cpu": {"n_layer": 6, "n_embd": 256, "n_head": 4, "seq": 256, "batch": 16, "m": [4, 16]},
    "cuda": {"n_layer": 12, "n_embd": 1024, "n_head": 16, "seq": 512, "batch": 64, "m": [4, 16]},
}
DEFAULT_RUNS = {"cpu": (1, 3), "cuda": (3, 10)}  # (warm-up steps, timed steps) per round
MIB = 2**20


@dataclass
class Case:
    """One benchmarked configuration."""

    n_layer: int
    n_embd: int
    n_head: int
    seq: int
    batch: int
    m: int

    def label(self, precision: str, device: str) -> str:
        return (f"GPT {self.n_layer}x{self.n_embd} h{self.n_head}, seq {self.seq}, batch {self.batch}, m {self.m}, "
                f"{precision}, {device}")

    def overrides(self) -> list[str]:
        return [f"model.n_layer={self.n_layer}", f"model.n_embd={self.n_embd}", f"model.n_head={self.n_head}",
                f"data.seq_len={self.seq}", f"data.batch_size={self.batch}", f"pipeline.num_microbatches={self.m}"]


def parse_cases(device: str, specs: list[list[str]] | None) -> list[Case]:
    """The device's default cases, each ``--case key=value ...`` overriding them (m: a comma list)."""
    groups = specs or [[]]
    cases = []
    for spec in groups:
        values: dict[str, Any] = dict(DEFAULT_CASES[device])
        for item in spec:
            key, sep, value = item.partition("=")
            if not sep or key not in CASE_KEYS:
                raise SystemExit(f"--case {item!r}: expected key=value with key one of {', '.join(CASE_KEYS)}")
            values[key] = [int(v) for v in value.split(",")] if key == "m" else int(value)
        ms = values.pop("m")
        for m in ms if isinstance(ms, list) else [ms]:
            if m < 1 or values["batch"] % m:
                raise SystemExit(f"--case batch={values['batch']} m={m}: the plain loop divides each micro-batch's "
                                 "loss by m, so m must divide the batch (pipeflow weighs unequal ones by tokens)")
            cases.append(Case(m=m, **values))
    return cases


def compose(overrides: list[str]) -> Any:
    """The resolved config from ``configs/`` with `overrides`, as ``train.py`` would see it."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from pipeflow.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """The plain PyTorch loop over the same layers as the config's GPT."""

    def __init__(self, cfg: Any, device: torch.device, trainer: Trainer) -> None:
        model = {k: v for k, v in cfg.model.items() if k != "_target_"}
        spec = build_gpt(**model)
        if spec.tied:
            raise SystemExit("model.tie_embeddings=true: the plain loop does not tie weights; benchmark untied")
        self.cfg, self.device, self.batches = cfg, device, trainer.plan.batches
        self.layers = spec.build_all(device=device, dtype=getattr(torch, cfg.train.param_dtype))
        self.params = unique_parameters(layer.parameters() for layer in self.layers)
        self.autocast = compute_dtype(cfg.train.precision)
        self.m = cfg.pipeline.num_microbatches
        d = local_optimizer(trainer.loop.update.optimizer).defaults  # pipeflow's own AdamW settings
        self.optimizer = torch.optim.AdamW(self.params, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                                           weight_decay=d["weight_decay"], amsgrad=d.get("amsgrad", False),
                                           foreach=d.get("foreach"), fused=d.get("fused"))

    def step(self, step: int, read_back: bool = False) -> tuple[float, float] | None:
        """One optimizer step on batch `step`; with `read_back`, (loss, grad norm) as floats."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        x, y = self.batches.train.get(step)
        m, total = self.m, None
        for xb, yb in zip(split_microbatches(x, m), split_microbatches(y, m)):
            xb, yb = xb.to(self.device), yb.to(self.device)
            with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                logits = run_layers(self.layers, xb)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), yb.reshape(-1)) / m
            loss.backward()
            if read_back:
                total = loss.detach() if total is None else total + loss.detach()
        norm = None
        if self.cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if read_back:
            return float(total), float(norm) if norm is not None else math.nan
        return None

    def resident_bytes(self) -> int:
        """What the plain loop holds between steps: its parameters and AdamW state, each storage once."""
        seen: dict[int, int] = {}
        tensors = list(self.params) + [t for state in self.optimizer.state.values() for t in state.values()
                                       if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.device.type == self.device.type:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


class PipeflowSteps:
    """pipeflow's training step, driven as ``Trainer.fit`` drives it (``steady``: the step's loss
    and norm read back a step late where the trainer allows it, ``Trainer.defers_readback``) or
    by the public ``Trainer.train_step`` (``train_step``: read back within the step)."""

    def __init__(self, trainer: Trainer, mode: str) -> None:
        self.trainer = trainer
        # Trainer.advance is the step fit's loop runs; a Trainer without it has only train_step
        self.mode = mode if hasattr(trainer, "advance") else "train_step"
        self.previous: Any = None

    def step(self, step: int) -> None:
        if self.mode == "train_step":
            self.trainer.train_step(step)
            return
        self.previous, _ = self.trainer.advance(step, self.previous)

    def drain(self) -> None:
        """Read back the step still pending (as fit does before an evaluation, a save or the end)."""
        if self.previous is not None:
            self.trainer.finish(self.previous)
            self.previous = None


def timed_block(run_step: Callable[[int], Any], first: int, warmup: int, steps: int, device: torch.device,
                drain: Callable[[], None] = lambda: None) -> tuple[float, int | None, int]:
    """Warm-up steps, then `steps` steps timed as one block (`drain` ends it: what is still
    pending is read back); returns (seconds per step, the allocator peak of the timed steps on
    CUDA else None, the next step number)."""
    for k in range(warmup):
        run_step(first + k)
    first += warmup
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for k in range(steps):
        run_step(first + k)
    drain()
    sync(device)
    took = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return took / steps, peak, first + steps


def run_case(case: Case, args: argparse.Namespace, device: torch.device, run_root: str) -> tuple[bool, str]:
    """Check and time one case; prints its lines; returns (whether the correctness check passed,
    the case's last line)."""
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    overrides = [*case.overrides(), "schedule=1f1b", f"train.precision={precision}", f"dist.device={device}",
                 "metrics.tensorboard=false", "metrics.progress_bar=false", "metrics.memory_steps=[]",
                 "train.eval_every=0", "train.eval_batches=0", "pipeline.profile=true",
                 f"train.run_dir={tempfile.mkdtemp(prefix='run_', dir=run_root)}", *args.override]
    cfg = compose(overrides)
    from pipeflow.run.builder import build_run

    trainer = build_run(cfg, device)
    plain = Plain(cfg, device, trainer)
    label = case.label(precision, device.type)
    try:
        same = all(torch.equal(a.detach(), b.detach()) for a, b in zip(trainer.parts.params, plain.params))
        if not same or len(trainer.parts.params) != len(plain.params):
            line = f"{label} | check FAILED: the two models do not start from identical weights"
            print(line, flush=True)
            return False, line
        # correctness: the first step from identical weights
        pf_loss, pf_norm = trainer.train_step(0)
        pl_loss, pl_norm = plain.step(0, read_back=True)
        rtol = args.rtol if args.rtol is not None else (1e-5 if precision == "fp32" else 1e-3)
        diff = abs(pf_loss - pl_loss) / max(abs(pl_loss), 1e-30)
        norm_diff = abs(pf_norm - pl_norm) / max(abs(pl_norm), 1e-30) if math.isfinite(pl_norm) else 0.0
        ok = diff <= rtol and norm_diff <= rtol
        check = (f"{label} | check: first-step loss plain {pl_loss:.6f} / pipeflow {pf_loss:.6f} "
                 f"(rel diff {diff:.1e}), "
                 f"grad norm plain {pl_norm:.6f} / pipeflow {pf_norm:.6f} (rel diff {norm_diff:.1e}), rtol {rtol:g}: "
                 f"{'ok' if ok else 'DISAGREE'}; AdamW fused={bool(plain.optimizer.defaults.get('fused'))} in both "
                 f"(optim.fused={OmegaConf.select(cfg, 'optim.fused', default='absent')})")
        print(check, flush=True)
        setting = OmegaConf.select(cfg, "optim.fused", default=False)  # null: fused on CUDA
        wanted = device.type == "cuda" if setting is None else bool(setting)
        if wanted != bool(plain.optimizer.defaults.get("fused")):
            print(f"  note: optim.fused={setting} resolves to fused={wanted} on {device.type}, but pipeflow's AdamW "
                  f"has fused={bool(plain.optimizer.defaults.get('fused'))}; the plain loop follows pipeflow's AdamW",
                  flush=True)
        if not ok:
            return False, check
        warmup = args.warmup if args.warmup is not None else DEFAULT_RUNS[device.type][0]
        steps = args.steps if args.steps is not None else DEFAULT_RUNS[device.type][1]
        times: dict[str, list[float]] = {"pipeflow": [], "plain": []}
        peaks: dict[str, list[float]] = {"pipeflow": [], "plain": []}
        next_step = {"pipeflow": 1, "plain": 1}
        steps_of = PipeflowSteps(trainer, args.pipeflow_step)
        runners = {"pipeflow": (steps_of.step, steps_of.drain), "plain": (plain.step, lambda: None)}
        for _ in range(args.rounds):
            for name in ("pipeflow", "plain"):  # alternating: pipeflow, plain, pipeflow, plain, ...
                at_rest = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                run, drain = runners[name]
                per_step, peak, next_step[name] = timed_block(run, next_step[name], warmup, steps, device, drain)
                times[name].append(per_step)
                if peak is not None:  # less what the other one holds between steps
                    other = plain.resident_bytes() if name == "pipeflow" else at_rest - plain.resident_bytes()
                    peaks[name].append((peak - other) / MIB)
        pf_s, pl_s = statistics.median(times["pipeflow"]), statistics.median(times["plain"])
        line = f"{label} | plain {1e3 * pl_s:.1f} ms | pipeflow {1e3 * pf_s:.1f} ms | step ratio {pf_s / pl_s:.3f}"
        if device.type == "cuda":
            pl_peak, pf_peak = max(peaks["plain"]), max(peaks["pipeflow"])
            line += f" | peak plain {pl_peak:.0f} / pipeflow {pf_peak:.0f} MiB | peak ratio {pf_peak / pl_peak:.3f}"
        predicted = trainer.plan.layout.prediction.step_s
        if math.isfinite(predicted):
            line += f" | predicted {1e3 * predicted:.1f} ms ({100 * predicted / pf_s:.0f}% of measured)"
        else:
            line += f" | predicted n/a ({trainer.plan.layout.prediction.basis}: no profiles)"
        if device.type == "cuda" and steps_of.mode == "steady":
            line += " | " + sync_check(trainer, next_step["pipeflow"], steps)
        print(line, flush=True)
        if args.verbose:
            late = steps_of.mode == "steady" and getattr(trainer, "defers_readback", False)
            print(f"  rounds (ms per step): pipeflow {[round(1e3 * t, 1) for t in times['pipeflow']]}, "
                  f"plain {[round(1e3 * t, 1) for t in times['plain']]}; pipeflow step: {steps_of.mode} "
                  f"(read back {'a step late' if late else 'within the step'}); prediction: "
                  f"{trainer.plan.layout.prediction.basis}", flush=True)
        return True, line
    finally:
        trainer.close()
        del trainer, plain
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def resident_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """What a training loop holds between steps: its parameters and optimizer state, each storage once."""
    seen: dict[int, int] = {}
    state = [t for values in optimizer.state.values() for t in values.values() if isinstance(t, torch.Tensor)]
    for t in list(params) + state:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type == device.type:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


COMPILED = ("pipeflow eager", "pipeflow compiled", "plain compiled", "zb_h1 compiled")
REPEATED = "zb_h1 compiled, backward repeated"


@contextlib.contextmanager
def repeated_backward(on: bool) -> Iterator[None]:
    """Within the block (when `on`), split-backward stages compile with torch's own backend: B and
    W each run the whole compiled backward (what pipeflow's split avoids; ``--repeat-backward``)."""
    from pipeflow.runtime import compiled_backward

    real = compiled_backward.split_backend
    if on:
        compiled_backward.split_backend = lambda backend, mode="default": backend
    try:
        yield
    finally:
        compiled_backward.split_backend = real


def run_compile_case(case: Case, args: argparse.Namespace, device: torch.device, run_root: str) -> tuple[bool, str]:
    """``--compile``: eager vs compiled pipeflow (1F1B), the compiled plain loop, and compiled
    zb_h1 (module docstring); prints the case's lines; returns (checks passed, its last line)."""
    from pipeflow.run.builder import build_run

    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    base = [*case.overrides(), f"train.precision={precision}", f"dist.device={device}", "metrics.tensorboard=false",
            "metrics.progress_bar=false", "metrics.memory_steps=[]", "train.eval_every=0", "train.eval_batches=0",
            "pipeline.profile=true", *args.override]
    compiled = ["train.compile=true", f"train.compile_backend={args.compile_backend}"]
    settings = {"pipeflow eager": ["schedule=1f1b"], "pipeflow compiled": ["schedule=1f1b", *compiled],
                "zb_h1 compiled": ["schedule=zb_h1", *compiled]}
    if args.repeat_backward:
        settings[REPEATED] = settings["zb_h1 compiled"]
    names = [*COMPILED, REPEATED] if args.repeat_backward else list(COMPILED)
    trainers: dict[str, Trainer] = {}
    started = {}
    for name, extra in settings.items():
        start = time.perf_counter()
        run_dir = tempfile.mkdtemp(prefix="run_", dir=run_root)
        with repeated_backward(name == REPEATED):
            trainers[name] = build_run(compose([*base, *extra, f"train.run_dir={run_dir}"]), device)
        started[name] = time.perf_counter() - start
    cfg = trainers["pipeflow compiled"].cfg
    plain = Plain(cfg, device, trainers["pipeflow compiled"])
    start = time.perf_counter()
    for layer in plain.layers:
        layer.compile(fullgraph=True, backend=args.compile_backend)
    label = case.label(precision, device.type)
    try:
        rtol = args.rtol if args.rtol is not None else (1e-4 if precision == "fp32" else 1e-2)
        want = plain.step(0, read_back=True)  # compiles the plain loop's layers
        started["plain compiled"] = time.perf_counter() - start
        ok, checks = True, []
        for name, trainer in trainers.items():
            got = trainer.train_step(0)
            diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, want)]
            ok = ok and max(diffs) <= rtol
            checks.append(f"{name} {max(diffs):.1e}")
        check = (f"{label} | check: first-step loss and grad norm against the compiled plain loop, rel diff "
                 f"{', '.join(checks)} (rtol {rtol:g}): {'ok' if ok else 'DISAGREE'}; start-up s "
                 + ", ".join(f"{name} {seconds:.1f}" for name, seconds in started.items()))
        print(check, flush=True)
        if not ok:
            return False, check
        warmup = args.warmup if args.warmup is not None else DEFAULT_RUNS[device.type][0]
        steps = args.steps if args.steps is not None else DEFAULT_RUNS[device.type][1]
        drivers = {name: PipeflowSteps(trainer, args.pipeflow_step) for name, trainer in trainers.items()}
        runners = {name: (d.step, d.drain) for name, d in drivers.items()}
        runners["plain compiled"] = (plain.step, lambda: None)
        holds = {name: resident_bytes(t.parts.params, local_optimizer(t.loop.update.optimizer), device)
                 for name, t in trainers.items()}
        times: dict[str, list[float]] = {name: [] for name in names}
        peaks: dict[str, list[float]] = {name: [] for name in names}
        next_step = dict.fromkeys(names, 1)
        graphs = graphs_compiled()
        for _ in range(args.rounds):
            for name in names:
                holds["plain compiled"] = plain.resident_bytes()
                at_rest = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                run, drain = runners[name]
                per_step, peak, next_step[name] = timed_block(run, next_step[name], warmup, steps, device, drain)
                times[name].append(per_step)
                if peak is not None:  # less what the others hold between steps
                    peaks[name].append((peak - (at_rest - holds[name])) / MIB)
        med = {name: statistics.median(values) for name, values in times.items()}
        line = (f"{label} | " + " | ".join(f"{name} {1e3 * med[name]:.1f} ms" for name in names)
                + f" | compiled/eager {med['pipeflow eager'] / med['pipeflow compiled']:.3f}x"
                f" | vs compiled plain {med['pipeflow compiled'] / med['plain compiled']:.3f}"
                f" | zb_h1/1f1b {med['zb_h1 compiled'] / med['pipeflow compiled']:.3f}")
        if args.repeat_backward:
            line += f" | repeated/split zb_h1 {med[REPEATED] / med['zb_h1 compiled']:.3f}"
        if device.type == "cuda":
            top = {name: max(values) for name, values in peaks.items()}
            line += (" | peak MiB " + ", ".join(f"{name} {top[name]:.0f}" for name in names)
                     + f" | peak vs compiled plain {top['pipeflow compiled'] / top['plain compiled']:.3f}")
        predicted = trainers["pipeflow compiled"].plan.layout.prediction.step_s
        if math.isfinite(predicted):
            line += f" | compiled predicted {1e3 * predicted:.1f} ms ({100 * predicted / med['pipeflow compiled']:.0f}%)"
        line += f" | graphs compiled during the timed rounds {graphs_compiled() - graphs}"  # recompiles: 0 expected
        print(line, flush=True)
        if args.verbose:
            print("  rounds (ms per step): " + "; ".join(f"{name} {[round(1e3 * t, 1) for t in times[name]]}"
                                                        for name in names), flush=True)
        return True, line
    finally:
        for trainer in trainers.values():
            trainer.close()
        del trainers, plain
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sync_check(trainer: Trainer, first: int, steps: int) -> str:
    """Run `steps` steady pipeflow steps under ``torch.cuda.set_sync_debug_mode("error")``, which
    raises at any host-device sync, except inside the documented one read-back per step (the
    previous step's packet, ``PendingStep.values``), which is counted; returns the result's text.

    Raises:
        RuntimeError: a sync outside the read-back (torch names the call)."""
    from pipeflow.run import trainer as trainer_module

    real, reads = trainer_module.PendingStep.values, []

    def allowed(pending: Any) -> list[float]:
        torch.cuda.set_sync_debug_mode("default")
        try:
            reads.append(pending.step)
            return real(pending)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    trainer_module.PendingStep.values = allowed
    previous = None
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for step in range(first, first + steps):
            previous, _ = trainer.advance(step, previous)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer_module.PendingStep.values = real
    if previous is not None:
        trainer.finish(previous)
    late = len(reads) == steps - 1
    return (f"sync check: {steps} steady steps, no sync but {len(reads)} read-backs "
            f"({'one per step, a step late' if late else 'within the step'})")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_one_rank(device_type: str, threads: int | None) -> torch.device:
    """The device ``--device`` names (``cuda`` is GPU 0), ``--threads`` applied, and a process
    group of one rank on it (NCCL on CUDA, gloo on the CPU), as the benchmarks here run."""
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, **kwargs)
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/overhead/vs_plain_loop.py",
        description="pipeflow on one rank (one stage, 1F1B, the Trainer's training step) against the plain "
                    "PyTorch loop over the same layers, weights, micro-batches and optimizer, in alternating "
                    "rounds; prints one line per case with 'step ratio' (and on CUDA 'peak ratio') and pipeflow's "
                    "start-of-run predicted step beside its measured median.",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo, GPT 6x256, seq 256, batch 16; cuda: NCCL on cuda:0, GPT 12x1024, 16 heads, "
                             "seq 512, batch 64, bf16; m = 4 and 16 on both (default cpu)")
    parser.add_argument("--case", nargs="+", action="append", metavar="KEY=VALUE",
                        help=f"override the device's default case ({', '.join(CASE_KEYS)}; m may be a comma list, "
                             "one case per value); repeat --case for more case sets")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds (pipeflow, plain) per case (default 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per round (default: 3 on cpu, 10 on cuda)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before each round's timed block (default: 1 on cpu, 3 on cuda)")
    parser.add_argument("--pipeflow-step", choices=("steady", "train_step"), default="steady",
                        help="steady: the step Trainer.fit runs (loss and norm read back a step late where the "
                             "trainer allows it); train_step: the public Trainer.train_step (read back within the "
                             "step) (default steady)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="autocast dtype of both (train.precision); default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance of the first-step loss and grad-norm check (default 1e-5 in fp32, "
                             "1e-3 otherwise)")
    parser.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more Hydra overrides for pipeflow's config (e.g. metrics.rehearse_steps=0); model.* "
                             "keys apply to the plain loop's GPT too")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for both (default: torch's own, one per core)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="also append the case lines to FILE (markdown, e.g. benchmarks/RESULTS.md) with the "
                             "command, machine, torch and date")
    parser.add_argument("--compile", action="store_true",
                        help="train.compile: pipeflow eager and compiled (1f1b), the compiled plain loop, and "
                             "compiled zb_h1, side by side (see the module docstring)")
    parser.add_argument("--compile-backend", choices=("inductor", "aot_eager"), default="inductor",
                        help="with --compile: train.compile_backend and the plain loop's backend (default inductor)")
    parser.add_argument("--repeat-backward", action="store_true",
                        help="with --compile: also compiled zb_h1 whose B and W each run the whole compiled backward "
                             "(torch's own backend; what the split avoids), and the ratio to the split one")
    parser.add_argument("--verbose", action="store_true", help="also print each round's step times")
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    cases = parse_cases(args.device, args.case)
    device = start_one_rank(args.device, args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()} CPU cores"
    print(f"pipeflow vs the plain loop: {name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds, medians over rounds, "
          f"ratio = pipeflow / plain", flush=True)
    ok, lines = True, []
    try:
        with tempfile.TemporaryDirectory(prefix="pipeflow_vs_plain_") as run_root:
            for case in cases:
                passed, line = (run_compile_case if args.compile else run_case)(case, args, device, run_root)
                ok = ok and passed
                lines.append(line)
    finally:
        dist.destroy_process_group()
    if args.out:
        from benchmarks.runner import append_result

        title = "train.compile: eager vs compiled, one rank" if args.compile else "pipeflow vs the plain PyTorch loop, one rank"
        append_result(args.out, title,
                      f"python {' '.join(sys.argv)}", "\n".join(f"    {line}" for line in lines),
                      backend="nccl" if device.type == "cuda" else "gloo",
                      device_name=name if device.type == "cuda" else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
