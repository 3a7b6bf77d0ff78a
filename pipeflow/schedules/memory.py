"""Memory under a schedule (no torch): how many micro-batches' activations each stage holds at
most, and each rank's tensor bytes by category (`TensorBytes`), the quantity the runtime's
accountant (``pipeflow.runtime.memory``) measures."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeflow.schedules.ir import ACTIVATION, BACKWARD, FORWARD, WEIGHT, CommOp, PipelineSchedule, Program, Step


def stage_inflight(schedule: PipelineSchedule) -> list[int]:
    """``inflight[s]``: the most micro-batches whose F has run on stage s and whose backward has
    not yet released them (the W, or the B when no W follows), walking each rank's action order.

    1F1B gives ``S - s`` (at most m), GPipe m on every stage; this is what balancing by memory
    and the partition table's memory estimate charge each stage for.
    """
    split = schedule.split_backwards()
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for acts in schedule.actions:
        for a in acts:
            if a.kind == FORWARD and schedule.training:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == WEIGHT or (a.kind == BACKWARD and (a.stage, a.microbatch) not in split):
                held[a.stage] -= 1
    return peak


def rank_peaks(schedule: PipelineSchedule) -> list[int]:
    """``peaks[r]``: the most (stage, micro-batch) pairs rank r holds at once, walking its action
    order; the same as the simulator's ``peak_activations``, without timing anything."""
    split = schedule.split_backwards()
    peaks = []
    for acts in schedule.actions:
        held = peak = 0
        for a in acts:
            if a.kind == FORWARD and schedule.training:
                held += 1
                peak = max(peak, held)
            elif a.kind == WEIGHT or (a.kind == BACKWARD and (a.stage, a.microbatch) not in split):
                held -= 1
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------------------------------------
# Tensor bytes per rank: the one definition of tracked memory, measured (pipeflow.runtime.memory)
# and predicted (tensor_memory below) alike.

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm")
SHARD_MODES = ("none", "optimizer", "full")


@dataclass(frozen=True)
class TensorBytes:
    """Bytes of the tensors one rank holds on its device, each storage once, by what it is.

    A storage is counted in the first category that holds it, in the order params, grads,
    optimizer, comm, activations.

    Attributes:
        params: the parameters (the local shard of a sharded one; the unsharded copy too while
            it exists during a step).
        grads: the parameters' ``.grad``.
        optimizer: the optimizer's state tensors (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``).
        comm: the transport's buffers: receive buffers (posted, lent to a micro-batch until its
            last backward, or free in the pool) and tensors being sent.
        activations: what is kept for backward: tensors autograd saved, the stages' kept inputs,
            outputs and per-layer boundaries, the gradients a split backward keeps for W, and
            the step's data (stage 0's inputs, the last stage's targets).
    """

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    comm: float = 0.0

    @property
    def total(self) -> float:
        """All categories together: the tracked quantity."""
        return self.params + self.grads + self.optimizer + self.activations + self.comm

    def as_tuple(self) -> tuple[float, ...]:
        """The categories in ``CATEGORIES`` order."""
        return tuple(getattr(self, c) for c in CATEGORIES)


@dataclass(frozen=True)
class RankMemory:
    """One rank's tensor bytes at the two points that matter.

    Attributes:
        resident: at the end of a step, after the optimizer step and before the gradients are
            released (what stays between steps, gradients included).
        peak: the largest total sampled after any compute action of a step, by category.
    """

    resident: TensorBytes
    peak: TensorBytes


@dataclass(frozen=True)
class StageBytes:
    """What one stage costs in tensor bytes (from the layer profiles).

    Attributes:
        params: bytes of its parameters.
        activations: bytes one micro-batch keeps from its F to its last backward half
            (received inputs excluded: they are receive buffers; its last outputs excluded when
            they are sent to another rank: freed once sent).
        split_held: bytes a split backward's B adds until its W (each layer's output gradients).
        boundary: bytes of its outputs sent to the next stage (and of their gradients coming back).
        loss: bytes the loss keeps (last stage) from the F until the first backward half: a
            split B frees them, as they sit above the layers' outputs that W starts from.
        data: bytes of the step's data the stage reads, held for the whole step (stage 0: every
            micro-batch's input; the last stage: every micro-batch's targets).
        offloadable: bytes of one micro-batch's activations that offloading moves to the host
            (``pipeline.offload``): what autograd saved, less what the stage keeps on the device
            anyway (its received inputs, the outputs it keeps for a split backward's W).
        trainable: bytes of the parameters that train, which alone have gradients and optimizer
            state (a LoRA run's adapters); None: all of them.
    """

    params: float
    activations: float
    split_held: float = 0.0
    boundary: float = 0.0
    loss: float = 0.0
    data: float = 0.0
    offloadable: float = 0.0
    trainable: float | None = None


def _param_side(params: float, dp: int, shard: str, optimizer_factor: float, in_step: bool, grads_on: bool,
                trainable: float | None = None) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of parameters `params` under `shard` over `dp` replicas;
    gradients and optimizer state only for the `trainable` bytes of them (None: all; a LoRA
    run's adapters).

    ``optimizer`` (ZeRO-1) keeps 1/dp of the optimizer state (whole tensors per rank: up to one
    parameter's state more); ``full`` (FSDP2) keeps 1/dp of all three between steps and, during a
    step, the unsharded parameters and their unsharded gradients beside the shards.
    """
    share, trains = params / dp, params if trainable is None else trainable
    optimizer = optimizer_factor * (trains if shard == "none" else trains / dp)
    if shard != "full":
        return params, trains if grads_on else 0.0, optimizer
    if in_step:  # sharded params + the all-gathered copy; grads unsharded until reduce-scattered
        return share + params, trains if grads_on else 0.0, optimizer
    return share, trains / dp, optimizer


def tensor_memory(
    schedule: PipelineSchedule,
    stages: Sequence[StageBytes],
    optimizer_factor: float = 2.0,
    dp: int = 1,
    shard: str = "none",
    programs: Sequence[Program] | None = None,
    microbatch_sizes: Sequence[float] | None = None,
    eval_programs: Sequence[Program] | None = None,
    timing: Any = None,
) -> list[RankMemory]:
    """Predict each rank's tensor bytes (`TensorBytes`) resident between steps and at its in-step peak.

    Walks rank r's actions as the runtime runs them, sampling after every compute action as the
    accountant does: an F adds its stage's activations (and loss), a split B its ``split_held``
    (and frees the loss), the last backward half of (stage, micro-batch) frees the rest; a stage's gradients exist from its first
    weight-grad action on.  With `programs` (the lowered programs the runtime interprets) the
    comm buffers are walked too: the receive pool holds, per buffer size, the most buffers lent
    at once (a buffer is lent from its post to its micro-batch's last backward on that stage);
    a sent tensor lives from the action producing it to the wait completing its send.
    `microbatch_sizes`: each micro-batch's activations relative to the profiled one's (variable
    lengths); default 1 each.  `eval_programs`: the forward-only programs of the run's
    evaluation, which holds every buffer it receives until its pass ends; the pool keeps, per
    buffer size, the larger count of the two passes.  Programs with offload marks
    (``pipeline.offload``) release a group's ``offloadable`` bytes after the sample of its F (with
    `timing`, the simulated run of those programs: at the first sample after its copy to the host
    has ended) and take them back before the sample of the step that reloads it.
    """
    if shard not in SHARD_MODES:
        raise ValueError(f"shard={shard!r}; use one of {SHARD_MODES}")
    split = schedule.split_backwards()
    size = microbatch_sizes or [1.0] * schedule.num_microbatches
    result = []
    for r in range(schedule.num_ranks):
        mine = [s for s, owner in enumerate(schedule.stage_to_rank) if owner == r]
        steps = programs[r] if programs is not None else [Step((), a) for a in schedule.actions[r]]
        pool = _pool_bytes(steps, stages, split, eval_programs[r] if eval_programs is not None else ()) \
            if programs is not None else 0.0
        sends = _send_bytes(steps, stages) if programs is not None else [0.0] * len(steps)
        resident = [_param_side(stages[s].params, dp, shard, optimizer_factor, False, True, stages[s].trainable)
                    for s in mine]
        data = math.fsum(stages[s].data for s in mine)
        held, grads_on, best = 0.0, set(), None
        leaving: list[tuple[float, float]] = []  # (when the copy to the host ends, bytes) not released yet
        for k, step in enumerate(steps):
            a = step.action
            for s, i in step.reload:
                held += stages[s].offloadable * size[i]
            if leaving:
                now_t = timing.step_times[r][k][2] if timing is not None else math.inf
                held -= math.fsum(n for t, n in leaving if t <= now_t)
                leaving = [(t, n) for t, n in leaving if t > now_t]
            if a is None:
                continue
            last = a.kind == WEIGHT or (a.kind == BACKWARD and (a.stage, a.microbatch) not in split)
            cost, n = stages[a.stage], size[a.microbatch]
            if a.kind == FORWARD and schedule.training:
                held += (cost.activations + cost.loss) * n
            elif a.kind == BACKWARD and (a.stage, a.microbatch) in split:
                held += (cost.split_held - cost.loss) * n
            elif a.kind == WEIGHT:
                held -= (cost.activations + cost.split_held) * n
            elif last:
                held -= (cost.activations + cost.loss) * n
            if last:
                grads_on.add(a.stage)
            sides = [_param_side(stages[s].params, dp, shard, optimizer_factor, True, s in grads_on,
                                 stages[s].trainable) for s in mine]
            now = TensorBytes(*(math.fsum(x[c] for x in sides) for c in range(3)), max(held, 0.0) + data,
                              pool + sends[k])
            if best is None or now.total > best.total:
                best = now
            for s, i in step.offload:
                ends = timing.offload_ends.get((s, i), 0.0) if timing is not None else 0.0
                leaving.append((ends, stages[s].offloadable * size[i]))
        res = TensorBytes(*(math.fsum(x[c] for x in resident) for c in range(3)), 0.0, pool)
        result.append(RankMemory(res, best if best is not None else res))
    return result


def _last_backward(step: Step, split: set[tuple[int, int]]) -> bool:
    a = step.action
    return a is not None and (a.kind == WEIGHT or (a.kind == BACKWARD and (a.stage, a.microbatch) not in split))


def _op_bytes(op: CommOp, stages: Sequence[StageBytes]) -> float:
    """Bytes one op moves: the outputs of the boundary's earlier stage (or their gradients)."""
    return stages[min(op.src_stage, op.dst_stage)].boundary


def _pool_bytes(steps: Sequence[Step], stages: Sequence[StageBytes], split: set[tuple[int, int]],
                eval_steps: Sequence[Step] = ()) -> float:
    """Bytes of the receive pool in steady state: per buffer size, the most buffers lent at once
    in a training pass or (all of its receives) in an evaluation pass."""
    lent: dict[tuple[int, int], list[float]] = {}
    high: dict[float, int] = {}
    for b in [_op_bytes(op, stages) for step in eval_steps for op in step.ops if not op.is_send]:
        high[b] = high.get(b, 0) + 1
    for step in steps:
        for op in step.ops:
            if not op.is_send:
                lent.setdefault((op.dst_stage, op.microbatch), []).append(_op_bytes(op, stages))
                counts: dict[float, int] = {}
                for sizes in lent.values():
                    for b in sizes:
                        counts[b] = counts.get(b, 0) + 1
                for b, n in counts.items():
                    high[b] = max(high.get(b, 0), n)
        if _last_backward(step, split):
            lent.pop((step.action.stage, step.action.microbatch), None)
    return math.fsum(b * n for b, n in high.items())


def _send_bytes(steps: Sequence[Step], stages: Sequence[StageBytes]) -> list[float]:
    """``sends[k]``: bytes being sent right after step k's action (produced, not yet completed)."""
    produced: dict[tuple[str, int, int], int] = {}
    for k, step in enumerate(steps):
        a = step.action
        if a is not None:
            produced[(a.kind, a.microbatch, a.stage)] = k
    live = [0.0] * len(steps)
    for k, step in enumerate(steps):
        for op, after in [(op, False) for op in step.waits] + [(op, True) for op in step.after]:
            if not op.is_send:
                continue
            kind = FORWARD if op.payload == ACTIVATION else BACKWARD
            start = produced.get((kind, op.microbatch, op.src_stage), k)
            for j in range(start, k + 1 if after else k):
                live[j] += _op_bytes(op, stages)
    return live
