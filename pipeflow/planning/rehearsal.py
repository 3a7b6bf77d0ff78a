"""A rehearsal of the program before the run: its own stages, on its own groups, on a sample.

Where several ranks share a host's cores (4 ranks on 2 cores), what an action or a transfer
costs depends on what the other ranks do at that moment: the scheduler hands a core to a rank
whose delivery has arrived only when another gives one up, and a layer computing beside three
others runs slower than the lone layer the profile timed.  A model of that (processor sharing, a
transfer timed while a thread computes) stays a model, and on such a host its error is larger
than the bubble it predicts.  So a run on shared cores rehearses instead: before the first step
every rank interprets its own program (the lowering it will run) with its own stages on the
first batch, for a few steps, through the same interpreter, transport and event recorder as a
training step, and :func:`pipeflow.planning.calibration.calibrate` turns the record into costs
(per-stage F, B, W, transfers, posting, start offsets).  The start-of-run prediction is that
calibration simulated, plus the measured tail (optimizer, all-reduces) and the end-of-step wait
the rehearsal saw (data-parallel replicas that share cores or links do not end together): the
calibrated model of this program on this host, known before step 0.  The rehearsal ran on the
run's own links (across hosts too), so their cost is in its transfers: the links measured at start
are not added on top (they were, and a 100 Mbit link between two emulated hosts was counted twice:
+30% with a stream's rate, +70% with the rate of both directions at once).

The program is rehearsed as the run runs it: ``parallel.shard=full``'s gathers and
reduce-scatters at its shard points, DualPipeV's pairs interleaved.  Nothing of the run changes:
no optimizer step, the gradients are dropped, buffers (BatchNorm statistics) restored and the
random state forked.  CPU only (on a GPU ranks do not share cores and the modelled prediction of
:mod:`pipeflow.planning.step_model` applies).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.planning.calibration import Calibration, RankStep, calibrate, on_rank0_clock, predict
from pipeflow.planning.profile import release_cached_memory
from pipeflow.planning.step_model import StepCosts, predict_step
from pipeflow.runtime.world.clocks import clock_offsets
from pipeflow.runtime.events import EventRecorder
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import Posting
from pipeflow.runtime.stage import Stage
from pipeflow.schedules import PipelineSchedule

Tensors = tuple[torch.Tensor, ...]
BUDGET_S = 1.5  # rehearsed steps per lowering: about this long (between MIN_STEPS and MAX_STEPS)
MIN_STEPS, MAX_STEPS = 3, 8


@contextlib.contextmanager
def untouched(stages: dict[int, Stage]) -> Iterator[None]:
    """Run the block with `stages` as they are afterwards: gradients dropped (they must be None
    before), buffers restored, the CPU random state forked."""
    params = [p for stage in stages.values() for p in stage.parameters()]
    if any(p.grad is not None for p in params):
        raise RuntimeError("a rehearsal needs stages without gradients (it drops the ones it makes)")
    buffers = [(b, b.detach().clone()) for stage in stages.values() for b in stage.module.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for p in params:
            p.grad = None
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for stage in stages.values():
            stage.losses.clear()


def rehearse(
    comm: Any, schedule: PipelineSchedule, stages: dict[int, Stage], inputs: Sequence[Tensors] | None,
    targets: Sequence[torch.Tensor] | None, posting: str, boundary_bytes: Sequence[float], steps: int,
    shapes: str = "static", warmup: int = 1, sharding: Any = None, overlap: bool = False,
) -> Calibration:
    """Interpret this rank's program of `schedule` lowered as `posting` with its `stages` on
    `inputs`/`targets` (the m micro-batches of stage 0's and the last stage's rank) for `warmup`
    + `steps` steps and calibrate on the recorded steps (see the module docstring).

    Collective over the world: every replica of a data-parallel run rehearses, as every replica
    will train; the first replica's record is calibrated, so every rank returns the same costs.
    """
    recorder = EventRecorder()
    # overlapped pairs (`overlap`) run interleaved, as the run runs them: calibrated as the run's own
    pipeline = Pipeline(stages, schedule, comm, shapes, Posting(lowering=posting), recorder, overlap_pairs=overlap,
                        sharding=sharding)
    one = torch.zeros(1, device=comm.device)
    record: list[RankStep] = []
    with untouched(stages):
        for n in range(warmup + steps):
            start = recorder.start()
            pipeline.run(inputs, targets)
            dist.all_reduce(one)  # as the grad-norm all-reduce: every rank starts the next step together
            events = recorder.stop()
            if n >= warmup:
                record.append(RankStep(start, recorder.stopped_at, [(e.kind, e.name, e.start, e.end) for e in events]))
    gathered: list[Any] = [None] * dist.get_world_size()
    first_replica = comm.global_rank(0) == 0  # as the run's own calibration: the pipeline of global rank 0
    offset = clock_offsets(comm.device)[dist.get_rank()]  # records onto rank 0's clock (several hosts: other boots)
    dist.all_gather_object(gathered, (comm.rank, [on_rank0_clock(r, offset) for r in record]) if first_replica else None)
    by_rank = dict(g for g in gathered if g is not None)
    recorded = [[by_rank[r][n] for r in range(schedule.num_ranks)] for n in range(steps)]
    return calibrate(schedule, recorded, boundary_bytes, postings=(posting,), meta={"rehearsal": True},
                     shard=sharding is not None, overlap=overlap and bool(schedule.pairs))


def rehearsal_steps(estimate_s: float, budget_s: float = BUDGET_S, most: int = MAX_STEPS) -> int:
    """How many steps to rehearse for a step of about `estimate_s`: about `budget_s` in all,
    between :data:`MIN_STEPS` and `most`."""
    if not estimate_s > 0:
        return most
    return max(MIN_STEPS, min(most, int(budget_s / estimate_s)))


def with_rehearsal(
    costs: StepCosts, comm: Any, schedule: PipelineSchedule, ranges: Sequence[range], profiles: Sequence[Any],
    stages: dict[int, Stage], inputs: Sequence[Tensors] | None, targets: Sequence[torch.Tensor] | None,
    boundary_bytes: Sequence[float], postings: Sequence[str], steps: int | None = None, shapes: str = "static",
    sharding: Any = None,
) -> StepCosts:
    """`costs` with the program rehearsed (:func:`rehearse`): each lowering the run may choose
    (``comm.post_recvs=auto``: both) for `steps` steps (None: :func:`rehearsal_steps` of the
    modelled step), the one that simulates faster kept, as auto keeps the one that runs faster.
    `sharding` (``parallel.shard=full``'s FSDP2 units): rehearsed with their gathers and
    reduce-scatters, whose time the calibration keeps, so the model's own shard cost goes.
    Collective over the world."""
    if steps is None:
        estimate = torch.tensor([predict_step(schedule, ranges, profiles, costs).makespan], dtype=torch.float64)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX)  # every rank rehearses as many steps
        steps = rehearsal_steps(float(estimate))
    best: tuple[float, Calibration] | None = None
    for posting in postings:
        cal = rehearse(comm, schedule, stages, inputs, targets, posting, boundary_bytes, steps, shapes,
                       sharding=sharding, overlap=costs.overlap_pairs)
        step_s = predict(schedule, cal).step_s - cal.tail_s
        if best is None or step_s < best[0]:
            best = (step_s, cal)
    release_cached_memory(comm.device)  # the rehearsals' pipelines and activations are gone: hand them back
    assert best is not None
    # the tail: the reductions and the optimizer as measured at start, then the end-of-step wait
    # the rehearsal saw (for the slowest replica and the synchronizing all-reduce)
    return replace(costs, posting=best[1].posting, rehearsed=best[1], tail_s=costs.tail_s + best[1].tail_s,
                   shard_s=None if sharding is not None else costs.shard_s)
