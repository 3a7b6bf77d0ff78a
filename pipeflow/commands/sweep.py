"""Sweeps: every combination of a Hydra multirun in one torchrun launch, and the comparison table.

    torchrun --nproc-per-node 4 train.py -m schedule=1f1b,interleaved_1f1b,zbv \\
        pipeline.num_microbatches=4,8,16 train.max_steps=20

Hydra's basic launcher runs the jobs one after another inside each process, in the same order
on every rank (the command lines are identical).  The process group is created by the first
job and reused by the others; it is torn down once, at exit (barrier, then destroy).  Rank 0
picks the sweep directory once (``train.run_dir``, else an explicit ``hydra.sweep.dir``, else
``outputs/sweep_<time>``; `pipeflow.run.run_dir`) and job k
writes into ``<sweep dir>/<k>_<swept overrides>``, so each job has its own config, TensorBoard
run and checkpoints.  A job whose combination the schedule or the config cannot run (a
ConfigError or ScheduleError while building, on any rank) is skipped on every rank with a
message.  After each job rank 0 rewrites ``sweep.md`` and ``sweep.csv`` (jobs sorted by
throughput); at the end of the sweep it prints the table.
"""
from __future__ import annotations

import atexit
import csv
import gc
import logging
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write

from pipeflow.errors import ConfigError, ScheduleError
from pipeflow.run.run_dir import agree_sweep_dir

log = logging.getLogger("pipeflow")


@dataclass
class JobRecord:
    """One finished job of a sweep: its overrides and what it measured (NaN: not measured).

    Memory, per pipeline rank: ``tensor_mb`` measured and ``predicted_memory_mb`` predicted are
    one quantity (tensor bytes, ``pipeflow.schedules.memory.TensorBytes``, at the in-step peak);
    ``rss_mb`` is the process's peak RSS and ``allocator_peak_mb`` CUDA's max allocated (NaN off a
    GPU); ``peak_memory_mb`` is the latter on a GPU, else the former (as TensorBoard's
    ``stage/<r>/peak_memory_mb``).
    """

    job: int
    overrides: str
    run_dir: str
    samples_per_s: float
    tokens_per_s: float
    step_time_ms: float
    bubble_measured: float
    bubble_predicted: float
    predicted_step_ms: float
    peak_memory_mb: list[float]
    predicted_memory_mb: list[float]
    final_loss: float
    tensor_mb: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    allocator_peak_mb: list[float] = field(default_factory=list)
    calibrated_step_ms: float = math.nan  # the run's own costs re-simulated (pipeflow.planning.calibration)


@dataclass
class SweepState:
    """The sweep directory, chosen once, and the jobs done so far (kept on rank 0)."""

    dir: str
    records: list[JobRecord] = field(default_factory=list)
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (job, overrides, why)


_STATE: SweepState | None = None


def is_multirun() -> bool:
    """True inside a job of a Hydra multirun (``train.py -m ...``)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def swept_keys(argv: list[str]) -> set[str]:
    """The keys the command line sweeps over (``a=1,2`` or ``a=range(...)``), from its overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(words)
    except Exception:  # an unparsable command line fails in Hydra itself; name jobs by all overrides
        return {a.split("=", 1)[0].lstrip("+~") for a in words}
    return {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}


def job_label(index: int, overrides: list[str], keys: set[str]) -> tuple[str, str]:
    """(the job's swept overrides as text, its sub-directory name ``<k>_<overrides>``)."""
    mine = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys] or overrides
    text = " ".join(mine)
    name = re.sub(r"[^A-Za-z0-9._=,+\-\[\]]", "_", ",".join(mine))[:120]
    return text, f"{index}_{name}" if name else str(index)


def _state(cfg: DictConfig) -> SweepState:
    """The sweep's state; on the first job rank 0 picks the directory (`pipeflow.run.run_dir.agree_sweep_dir`)
    and every rank receives it."""
    global _STATE
    if _STATE is None:
        _STATE = SweepState(agree_sweep_dir(cfg.train.run_dir))
        atexit.register(_teardown)
    return _STATE


def _teardown() -> None:
    """At a normal exit: wait for every rank, then destroy the process group (a failed rank has
    left through `pipeflow.run.guard.fail`, which skips this)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_sweep_job(cfg: DictConfig, device: torch.device) -> JobRecord | None:
    """Run one job of a multirun on every rank: its own run directory, skipped when invalid.

    Returns:
        The job's record (on every rank), or None when the job was skipped.

    Any other failure ends the whole sweep (`pipeflow.run.guard.fail`: logged, exit 1 at once; torchrun
    stops the peers), since the ranks could no longer walk the sweep together.
    """
    state = _state(cfg)
    hydra_cfg = HydraConfig.get()
    index = hydra_cfg.job.num
    text, name = job_label(index, list(hydra_cfg.overrides.task), swept_keys(sys.argv[1:]))
    run_dir = os.path.join(state.dir, name)
    with read_write(cfg), open_dict(cfg):
        cfg.train.run_dir = run_dir
    try:
        record = _run_job(cfg, device, index, text, run_dir, state)
        dist.barrier()
    except Exception as exc:
        from pipeflow.run import guard

        log.error("rank %d: sweep job %d (%s) failed; stopping the sweep", dist.get_rank(), index, text)
        guard.fail(exc, dist.get_rank())
    if dist.get_rank() == 0:
        write_tables(state)
    return record


def _run_job(cfg: DictConfig, device: torch.device, index: int, text: str, run_dir: str,
             state: SweepState) -> JobRecord | None:
    from pipeflow.run.builder import build_run

    trainer, why = _build_agreed(lambda: build_run(cfg, device))
    if trainer is None:
        if dist.get_rank() == 0:
            log.warning("sweep job %d (%s) skipped: %s", index, text, why)
            state.skipped.append((index, text, why))
        return None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = trainer.fit()  # ends with trainer.close(): the watchdog thread stopped and joined
    record = _record(trainer, result, index, text, run_dir)
    trainer.close()  # (idempotent) nothing of this job may outlive it
    del trainer
    gc.collect()  # free this job's stages before the next job builds its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        state.records.append(record)
    return record


def _build_agreed(build: Any) -> tuple[Any, str]:
    """Build on every rank; if a ConfigError/ScheduleError happened on any rank, all skip together.

    Returns:
        (the built object, "") or (None, the first rank's error message).
    """
    built, why = None, ""
    try:
        built = build()
    except (ConfigError, ScheduleError) as err:
        why = f"{type(err).__name__}: {err}".splitlines()[0]
    errors: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, why)
    first = next((e for e in errors if e), "")
    return (built, "") if not first else (None, first)


def _record(trainer: Any, result: dict, index: int, text: str, run_dir: str) -> JobRecord:
    """The job's figures, from the fit() result (`pipeflow.observability.metrics.RunMetrics.close`: every key is
    always there; ``tokens_per_s`` is None for non-token data) and the layout's prediction
    (`pipeflow.planning.layout.Prediction`: step NaN and no memory without profiles)."""
    prediction = trainer.plan.layout.prediction
    tokens = result["tokens_per_s"]
    return JobRecord(
        job=index, overrides=text, run_dir=run_dir,
        samples_per_s=float(result["samples_per_s"]),
        tokens_per_s=math.nan if tokens is None else float(tokens),
        step_time_ms=1e3 * float(result["step_time_s"]),
        bubble_measured=float(result["bubble_measured"]),
        bubble_predicted=float(result["bubble_predicted"]),
        predicted_step_ms=1e3 * prediction.step_s, peak_memory_mb=[float(x) for x in result["peak_memory_mb"]],
        predicted_memory_mb=[b / 1e6 for b in prediction.memory_bytes], final_loss=float(result["last_loss"]),
        tensor_mb=[float(x) for x in result["tensor_mb"]], rss_mb=[float(x) for x in result["rss_mb"]],
        allocator_peak_mb=[float(x) for x in result["allocator_peak_mb"]],
        calibrated_step_ms=1e3 * float(result.get("step_calibrated_s", math.nan)),
    )


COLUMNS = ("job", "overrides", "samples_per_s", "tokens_per_s", "step_time_ms", "predicted_step_ms",
           "calibrated_step_ms", "bubble_measured", "bubble_predicted", "tensor_mb", "predicted_memory_mb", "rss_mb",
           "allocator_peak_mb", "peak_memory_mb", "final_loss", "run_dir")


def sorted_records(state: SweepState) -> list[JobRecord]:
    """The jobs, fastest (most samples per second) first."""
    return sorted(state.records, key=lambda r: (-r.samples_per_s, r.job))


def _cell(value: Any, digits: int = 1) -> str:
    if isinstance(value, list):
        return "/".join(_cell(v, digits) for v in value) or "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(state: SweepState) -> str:
    """The sweep as a Markdown table (fastest first) and the list of skipped jobs."""
    gpu = any(math.isfinite(v) for r in state.records for v in r.allocator_peak_mb)
    heads = ["job", "overrides", "samples/s", "step (ms)", "predicted step (ms)", "calibrated step (ms)",
             "bubble measured", "bubble predicted", "tensor MB/rank measured", "tensor MB/rank predicted",
             "process RSS MB/rank", *(["allocator peak MB/rank"] if gpu else []), "final loss"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in sorted_records(state):
        cells = [str(r.job), f"`{r.overrides}`", _cell(r.samples_per_s), _cell(r.step_time_ms),
                 _cell(r.predicted_step_ms), _cell(r.calibrated_step_ms),
                 _pct(r.bubble_measured), _pct(r.bubble_predicted), _cell(r.tensor_mb, 2),
                 _cell(r.predicted_memory_mb, 2), _cell(r.rss_mb, 0),
                 *([_cell(r.allocator_peak_mb)] if gpu else []), _cell(r.final_loss, 4)]
        lines.append("| " + " | ".join(cells) + " |")
    for job, text, why in state.skipped:
        lines.append(f"\nskipped job {job} (`{text}`): {why}")
    return "\n".join(lines)


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def write_tables(state: SweepState) -> None:
    """Write ``sweep.md`` and ``sweep.csv`` into the sweep directory (rank 0)."""
    os.makedirs(state.dir, exist_ok=True)
    with open(os.path.join(state.dir, "sweep.md"), "w") as f:
        f.write(f"# Sweep ({len(state.records)} jobs run, {len(state.skipped)} skipped)\n\n{format_table(state)}\n")
    with open(os.path.join(state.dir, "sweep.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for r in sorted_records(state):
            row = asdict(r)
            writer.writerow([";".join(f"{v:.3f}" for v in row[c]) if isinstance(row[c], list) else row[c]
                             for c in COLUMNS])


class SweepTable(Callback):
    """Hydra callback: at the end of a multirun, rank 0 prints the sweep table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Print where the tables are and the table itself (rank 0 of a distributed sweep)."""
        if _STATE is None or not dist.is_initialized() or dist.get_rank() != 0:
            return
        print(f"sweep: {len(_STATE.records)} jobs run, {len(_STATE.skipped)} skipped; "
              f"{os.path.join(_STATE.dir, 'sweep.md')}\n{format_table(_STATE)}", flush=True)
