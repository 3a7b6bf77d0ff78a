"""The run's calibrated prediction: its recorded steps (after the warm-up) gathered at the end,
turned into costs (`pipeflow.planning.calibration`), written to ``<run_dir>/costs.json`` and
simulated again; reported beside the measured step and the start-of-run prediction.
"""
from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from pipeflow.planning.calibration import COSTS_FILE, Calibration, RankStep, on_rank0_clock, predict
from pipeflow.runtime.world.clocks import clock_offsets
from pipeflow.schedules import PipelineSchedule

log = logging.getLogger("pipeflow")

WARMUP_STEPS = 2  # the run's first steps (shapes, allocator, auto's trials begin) are not calibrated
KEEP_STEPS = 50  # the most recent steps kept for the calibration


class CalibrationLog:
    """Keeps this rank's recent training steps and, at the end of the run, calibrates on rank 0.

    Args:
        calibrate: recorded steps (``steps[n][r]``) -> the run's :class:`Calibration`
            (:func:`pipeflow.planning.calibration.calibrate` with the run's schedule and sizes).
        pp_rank, num_pp: this rank's pipeline rank and the pipeline size.
        first_pipeline: this rank belongs to the first pipeline (the one holding global rank 0),
            whose records are calibrated (default: global rank < num_pp, the 2-D mesh's).
    """

    def __init__(self, calibrate: Callable[[list[list[RankStep]]], Calibration], pp_rank: int, num_pp: int,
                 first_pipeline: bool | None = None) -> None:
        self.calibrate, self.pp_rank, self.num_pp = calibrate, pp_rank, num_pp
        self.first_pipeline = dist.get_rank() < num_pp if first_pipeline is None else first_pipeline
        self.steps: deque[tuple[int, RankStep]] = deque(maxlen=KEEP_STEPS)

    def keep(self, step: int, start: float, end: float, events: list[Any]) -> None:
        """Keep one step's record (events as ``(kind, name, start, end)``)."""
        self.steps.append((step, RankStep(start, end, [(e.kind, e.name, e.start, e.end) for e in events])))

    def finish(self, schedule: PipelineSchedule, run_dir: str, predicted_step_s: float) -> dict[str, Any]:
        """Gather the first replica's records (collective), calibrate, write ``costs.json`` and
        log the comparison on rank 0.  Returns (every rank) ``step_calibrated_s`` (NaN when there
        was nothing to calibrate), ``finish_calibrated_s`` and ``finish_measured_s`` per rank."""
        offset = clock_offsets()[dist.get_rank()]  # records onto rank 0's clock (several hosts: other boots)
        mine = (self.pp_rank, [(n, on_rank0_clock(r, offset)) for n, r in self.steps]) if self.first_pipeline else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out: list[dict[str, Any]] = [{"step_calibrated_s": math.nan, "finish_calibrated_s": [],
                                      "finish_measured_s": []}]
        if dist.get_rank() == 0:
            out[0] = self._calibrate([g for g in gathered if g is not None], schedule, run_dir, predicted_step_s)
        dist.broadcast_object_list(out, src=0)
        return out[0]

    def _calibrate(self, gathered: list, schedule: PipelineSchedule, run_dir: str, predicted_s: float) -> dict:
        by_rank = dict(gathered)
        common = set.intersection(*(set(n for n, _ in steps) for steps in by_rank.values())) if by_rank else set()
        records = {r: dict(steps) for r, steps in by_rank.items()}
        steps = [[records[r][n] for r in range(self.num_pp)] for n in sorted(common)]
        nothing = {"step_calibrated_s": math.nan, "finish_calibrated_s": [], "finish_measured_s": []}
        if not steps:  # a run of a few steps (a smoke test; a resume at its last step) is no fault
            log.info("no calibrated prediction: no full-size step after the first %d (warm-up) was recorded",
                     WARMUP_STEPS)
            return nothing
        try:
            cal = self.calibrate(steps)
        except Exception as err:  # noqa: BLE001 - a report at the end must never fail the run it reports on
            log.warning("no calibrated prediction: %s: %s", type(err).__name__, err)
            return nothing
        path = os.path.join(run_dir, COSTS_FILE)
        with open(path, "w") as f:
            f.write(cal.to_json())
        calibrated = predict(schedule, cal)
        log.info(calibration_line(cal, calibrated.step_s, calibrated.finish_s, predicted_s, path))
        return {"step_calibrated_s": calibrated.step_s, "finish_calibrated_s": calibrated.finish_s,
                "finish_measured_s": cal.measured_finish_s}


def calibration_line(cal: Calibration, step_s: float, finish_s: list[float], predicted_s: float, path: str) -> str:
    """The comparison logged at the end: the step measured, predicted at start and calibrated, and
    each rank's end of program measured and calibrated."""
    ms = lambda xs: "/".join(f"{1e3 * x:.1f}" for x in xs)  # noqa: E731
    # no time predicted at start (no profile: F = B = W units) is said so, not printed as nan
    at_start = f"{1e3 * predicted_s:.1f} ms" if math.isfinite(predicted_s) else "none (no profile)"
    return (f"calibration over {cal.steps} steps ({cal.posting}): step measured {1e3 * cal.measured_step_s:.1f} ms, "
            f"predicted at start {at_start}, calibrated {1e3 * step_s:.1f} ms; end of program per "
            f"rank measured {ms(cal.measured_finish_s)} ms, calibrated {ms(finish_s)} ms; transfer "
            f"{1e3 * cal.latency_s:.3f} ms + {1e9 * cal.per_byte_s:.3f} ms/MB, tail {1e3 * cal.tail_s:.1f} ms; "
            f"costs in {path}")
