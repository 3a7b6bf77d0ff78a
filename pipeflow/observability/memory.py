"""Reporting tensor memory: every rank's measured :class:`~pipeflow.schedules.memory.TensorBytes`
beside the layout's prediction of the same quantity, on the console, in TensorBoard and in the
run's figures; the process's RSS and (on a GPU) the allocator's peak in their own columns.

Which steps are measured is ``metrics.memory_steps`` (default ``[1]``: the second step, the first
with optimizer state; a step past the last measures the last).  A measured step samples after
every compute action (``pipeflow.runtime.memory``); one all-gather per measured step brings
every global rank's figures to every rank.
"""
from __future__ import annotations

import logging
import math
import resource
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeflow.runtime.parallel.mesh_order import MeshGrid
from pipeflow.schedules.memory import CATEGORIES, RankMemory, TensorBytes

if TYPE_CHECKING:
    from pipeflow.planning.layout import Prediction

log = logging.getLogger("pipeflow")
MB = 1e6
_N = len(CATEGORIES)


def rss_mb() -> float:
    """The process's peak resident set size, MB (10^6 bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / MB if sys.platform == "darwin" else rss * 1024 / MB


def allocator_peak_mb(device: torch.device) -> float:
    """``torch.cuda.max_memory_allocated`` on a GPU, MB; NaN elsewhere (there is no allocator to ask)."""
    return torch.cuda.max_memory_allocated(device) / MB if torch.device(device).type == "cuda" else math.nan


class MemoryMetrics:
    """Gathers and reports the measured tensor memory of chosen steps (collective, like RunMetrics).

    Args:
        steps: the steps to measure (``metrics.memory_steps``); clamped to the last step.
        max_steps: ``train.max_steps``.
        pp_rank: this rank's pipeline rank (its prediction is the pipeline rank's).
        device: this rank's device.
        prediction: the layout's prediction (``memory`` empty without profiles).
        grid: every rank's mesh coordinates: with tp the table names each rank's dp and tp
            coordinates too.
    """

    def __init__(self, steps: Iterable[int], max_steps: int, pp_rank: int, device: torch.device,
                 prediction: Prediction, grid: MeshGrid | None = None) -> None:
        self.grid = grid if grid is not None else MeshGrid(1, 1)
        self.tp = self.grid.tp
        self.steps = {min(int(s), max_steps - 1) for s in steps if int(s) >= 0}
        self.pp_rank, self.device = pp_rank, device
        self.predicted = prediction.memory
        self.offloaded_predicted = prediction.offloaded_bytes  # per pipeline rank; empty: no offloading
        self.rows: list[dict[str, Any]] = []  # per global rank, of the last measured step
        self.step: int | None = None

    def measures(self, step: int) -> bool:
        """True if `step`'s tensor memory is measured."""
        return step in self.steps

    def record(self, step: int, measured: RankMemory, writer: Any = None, offloaded: float = math.nan) -> None:
        """Gather every rank's measurement of `step` (collective) and write it to TensorBoard;
        `offloaded`: the bytes this rank copied to the host in the step (``pipeline.offload``)."""
        packet = torch.tensor([self.pp_rank, *measured.resident.as_tuple(), *measured.peak.as_tuple(), offloaded,
                               rss_mb(), allocator_peak_mb(self.device)], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(packet) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, packet)
        self.step, self.rows = step, []
        for row in (g.cpu().tolist() for g in gathered):
            pp = int(row[0])
            predicted = self.predicted[pp] if pp < len(self.predicted) else None
            self.rows.append({
                "pp_rank": pp, "resident": TensorBytes(*row[1:1 + _N]), "peak": TensorBytes(*row[1 + _N:1 + 2 * _N]),
                "predicted": predicted, "offloaded": row[-3], "rss_mb": row[-2], "allocator_peak_mb": row[-1],
            })
        if writer is not None:
            for tag, value in self.scalars().items():
                writer.add_scalar(tag, value, step)

    def scalars(self) -> dict[str, float]:
        """The TensorBoard scalars of the last measured step, per global rank g: ``memory/<g>/params_mb``,
        ``grads_mb``, ``optimizer_mb`` (resident between steps), ``tensor_mb`` (the in-step
        peak), ``tensor_predicted_mb``, ``tensor_resident_mb``, ``peak_params_mb`` (the in-step
        peak's parameters: the unsharded copy included), ``activations_mb``, ``comm_mb``,
        ``rss_mb``, with ``pipeline.offload`` ``offloaded_mb`` (copied to the host in the step) and,
        on a GPU, ``allocator_peak_mb``."""
        out: dict[str, float] = {}
        for g, row in enumerate(self.rows):
            resident, peak, predicted = row["resident"], row["peak"], row["predicted"]
            tags = {
                "params_mb": resident.params, "grads_mb": resident.grads, "optimizer_mb": resident.optimizer,
                "tensor_mb": peak.total, "tensor_resident_mb": resident.total, "peak_params_mb": peak.params,
                "activations_mb": peak.activations, "comm_mb": peak.comm,
            }
            if predicted is not None:
                tags["tensor_predicted_mb"] = predicted.peak.total
            if not math.isnan(row["offloaded"]):
                tags["offloaded_mb"] = row["offloaded"]
            out.update({f"memory/{g}/{name}": v / MB for name, v in tags.items()})
            out[f"memory/{g}/rss_mb"] = row["rss_mb"]
            if not math.isnan(row["allocator_peak_mb"]):
                out[f"memory/{g}/allocator_peak_mb"] = row["allocator_peak_mb"]
        return out

    def summary(self, num_pp: int) -> dict[str, Any]:
        """Per pipeline rank (data-parallel replicas: the largest): ``tensor_mb`` (measured in-step
        peak, NaN when no step was measured), ``tensor_predicted_mb`` (NaN without profiles),
        ``rss_mb`` and ``allocator_peak_mb`` (NaN off a GPU); ``memory_step``: the step measured;
        with ``pipeline.offload``, ``offloaded_mb`` (copied to the host in the measured step) and
        ``offloaded_predicted_mb``."""
        measured = [math.nan] * num_pp
        offloaded = [math.nan] * num_pp
        rss = [math.nan] * num_pp
        allocator = [math.nan] * num_pp
        for row in self.rows:
            r = row["pp_rank"]
            measured[r] = _max(measured[r], row["peak"].total / MB)
            rss[r] = _max(rss[r], row["rss_mb"])
            allocator[r] = _max(allocator[r], row["allocator_peak_mb"])
            offloaded[r] = _max(offloaded[r], row["offloaded"] / MB)
        predicted = [m.peak.total / MB for m in self.predicted] or [math.nan] * num_pp
        figures = {"tensor_mb": measured, "tensor_predicted_mb": predicted, "rss_mb": rss,
                   "allocator_peak_mb": allocator, "memory_step": self.step}
        if self.offloaded_predicted:
            figures.update(offloaded_mb=offloaded, offloaded_predicted_mb=[b / MB for b in self.offloaded_predicted])
        return figures

    def table(self) -> str:
        """Per global rank: measured tensor MB by category (resident, then in-step peak) beside
        the prediction, then RSS and (GPU) the allocator's peak, each in its own column."""
        grid = self.tp > 1  # each rank's (dp, pp, tp) coordinates, its share of the stage's split weights
        heads = ["rank", *(["dp"] if grid else []), "pp", *(["tp"] if grid else []), "params", "grads", "optimizer",
                 "peak: params", "grads", "optimizer", "activations", "comm", "tensor MB measured", "predicted", "RSS MB",
                 "allocator peak MB"]
        moved = any(not math.isnan(row["offloaded"]) for row in self.rows)
        heads += ["offloaded MB"] if moved else []
        rows = []
        for g, row in enumerate(self.rows):
            predicted = row["predicted"]
            d, _, t = self.grid.coordinates(g)
            place = [str(d), str(row["pp_rank"]), str(t)] if grid else [str(row["pp_rank"])]
            rows.append([str(g), *place, *(_mb(v) for v in row["resident"].as_tuple()[:3]),
                         *(_mb(v) for v in row["peak"].as_tuple()), _mb(row["peak"].total),
                         "-" if predicted is None else _mb(predicted.peak.total), f"{row['rss_mb']:.0f}",
                         "-" if math.isnan(row["allocator_peak_mb"]) else f"{row['allocator_peak_mb']:.1f}",
                         *([_mb(row["offloaded"])] if moved else [])])
        widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(heads)]
        lines = [f"tensor memory at step {self.step} (MB; parameters, gradients, optimizer state resident between "
                 "steps, then the in-step peak), measured beside predicted:"]
        lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [heads, *rows]]
        return "\n".join(lines)


def _mb(value: float) -> str:
    return f"{value / MB:.2f}"


def _max(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def memory_line(summary: dict[str, Any]) -> str:
    """The end-of-run memory line, e.g. ``tensor memory per pipeline rank at step 1, MB measured |
    predicted: 3.10 | 3.02, 2.51 | 2.49 | process RSS 812, 640 MB`` (on a GPU the allocator's
    peak follows in its own field)."""
    pairs = ", ".join(f"{m:.2f} | {p:.2f}" for m, p in zip(summary["tensor_mb"], summary["tensor_predicted_mb"]))
    line = (f"tensor memory per pipeline rank at step {summary['memory_step']}, MB measured | predicted: {pairs} | "
            f"process RSS {', '.join(f'{v:.0f}' for v in summary['rss_mb'])} MB")
    if not all(math.isnan(v) for v in summary["allocator_peak_mb"]):
        line += f" | allocator peak {', '.join(f'{v:.0f}' for v in summary['allocator_peak_mb'])} MB"
    if "offloaded_mb" in summary:
        moved = ", ".join(f"{m:.2f} | {p:.2f}" for m, p in zip(summary["offloaded_mb"], summary["offloaded_predicted_mb"]))
        line += f" | activations offloaded to the host per step, MB measured | predicted: {moved}"
    return line
