"""What each training step runs on: its micro-batches, and under ``train.batch_ramp`` its size,
its micro-batch count and the schedule built for that count (one per count), with the figures
the metrics count for it.  The Trainer asks; nothing here runs a step."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from pipeflow.planning.layout import predict
from pipeflow.run.microbatch_split import MicroBatches, MicroBatchSplit
from pipeflow.run.phases import Loop, ModelParts, RunPlan, Topology
from pipeflow.schedules import PipelineSchedule, build_schedule


@dataclass
class StepBatches:
    """This rank's micro-batches of every step, and the schedule each training step runs.

    Attributes:
        cfg: the resolved config (``schedule``, ``data.batch_size``, ``train.param_dtype``).
        device: this rank's device.
        plan, topology, parts, loop: what the builder's phases returned (:mod:`pipeflow.run.phases`).
        ramp_schedules: the schedules built for a ramp's smaller micro-batch counts, by count.
    """

    cfg: DictConfig
    device: torch.device
    plan: RunPlan
    topology: Topology
    parts: ModelParts
    loop: Loop
    ramp_schedules: dict[int, PipelineSchedule] = field(default_factory=dict)
    _rows: dict[int, list[int]] = field(default_factory=dict, repr=False)  # keyed dropout's first rows, by size

    def microbatches(self, source: Any, step: int, batches_skipped: int = 0) -> MicroBatches:
        """This dp rank's micro-batches of batch `step` of `source` (:class:`MicroBatchSplit`); a
        training batch is drawn `batches_skipped` further on (batches a spike's rollback skipped).

        Raises:
            AllTargetsMaskedError: a training batch whose every target is masked.
        """
        schedule, stages, mesh = self.plan.schedule, self.parts.stages, self.topology.mesh
        training = source is self.plan.batches.train
        split = MicroBatchSplit(
            holds_first=0 in stages, holds_last=schedule.num_stages - 1 in stages,
            weighs=schedule.num_stages - 1 in stages or self.loop.update.routing is not None,
            dp_rank=mesh.dp_rank, cp_rank=mesh.cp_rank, cp=mesh.cp,
            dp=mesh.dp, microbatches=self.count(step) if training else schedule.num_microbatches,
            device=self.device,
            dtype=getattr(torch, self.cfg.train.param_dtype), loss_count=self.plan.spec.loss_count)
        return split.split(source, step + batches_skipped if training else step, training=training)

    def count(self, step: int) -> int:
        """Micro-batches each replica runs at training step `step` (``train.batch_ramp``: fewer early on)."""
        ramp = self.plan.ramp
        return self.plan.schedule.num_microbatches if ramp is None else ramp.microbatches_at(step)

    def schedule_at(self, step: int) -> PipelineSchedule:
        """The schedule of training step `step`: the run's, or under ``train.batch_ramp`` the same
        schedule built (``auto``: synthesised) for that step's micro-batch count (one per count)."""
        count, schedule = self.count(step), self.plan.schedule
        if count == schedule.num_microbatches:
            return schedule
        if count not in self.ramp_schedules:
            sc = self.cfg.schedule
            self.ramp_schedules[count] = (self.plan.reschedule(count) if self.plan.reschedule is not None else
                                          build_schedule(sc.name, schedule.num_ranks, count, sc.stages_per_rank,
                                                         sc.placement, sc.path, sc.stage_to_rank))
        return self.ramp_schedules[count]

    def ramp_line(self) -> str | None:
        """``train.batch_ramp``'s start-of-run line: its sizes, their micro-batch counts and first
        steps, and each size's predicted step (the start-of-run prediction scaled by what the
        simulator gives that count's program on the profiled costs); None without a ramp."""
        ramp = self.plan.ramp
        if ramp is None:
            return None
        line = f"batch ramp: {ramp.describe()}"
        layout = self.plan.layout
        if layout.profiles is None or not math.isfinite(layout.prediction.step_s):
            return line
        full = predict(self.plan.schedule, layout.ranges, layout.profiles).step_s
        steps = [layout.prediction.step_s * predict(self.schedule_at(ramp.steps_to(size)), layout.ranges,
                                                    layout.profiles).step_s / full for size in ramp.sizes()]
        return f"{line}; predicted step {' / '.join(f'{1e3 * s:.1f}' for s in steps)} ms"

    def ramp_batch(self, step: int) -> tuple[int, int | None, int, int | None]:
        """``train.batch_ramp``: training step `step`'s samples and tokens, and the samples and tokens
        trained by its end (tokens None for non-token data)."""
        ramp, (samples, tokens) = self.plan.ramp, self.loop.metrics.full_items
        per_sample = None if tokens is None else tokens / samples
        size, trained = ramp.size(step), ramp.consumed_before(step + 1)
        return (size, None if per_sample is None else round(size * per_sample), trained,
                None if per_sample is None else round(trained * per_sample))

    def first_rows(self, step: int) -> list[int]:
        """Each of this replica's micro-batches' first row in step `step`'s global batch (as
        :func:`pipeflow.data.shard` and the micro-batch split cut it: ``tensor_split``'s sizes,
        the first ones a row larger), in plain integers: a steady step reads nothing back."""
        size = int(self.cfg.data.batch_size) if self.plan.ramp is None else self.plan.ramp.size(step)
        if size not in self._rows:
            def starts(offset: int, rows: int, parts: int) -> list[tuple[int, int]]:
                part, extra = divmod(rows, parts)
                cuts = [offset + i * part + min(i, extra) for i in range(parts + 1)]
                return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(parts)]

            mesh = self.topology.mesh
            first, rows = starts(0, size, mesh.dp)[mesh.dp_rank]
            self._rows[size] = [start for start, _ in starts(first, rows, self.count(step))]
        return self._rows[size]
