"""The schedule IR: actions, schedules (actions per rank) and lowered programs (explicit steps).

Index letters used throughout the schedules package:
    p = number of pipeline ranks, S = number of stages, m = number of micro-batches,
    r = a rank, s = a stage, i = a micro-batch.

A schedule says, for every rank, the order of its compute actions.  Lowering turns it into a
*program*: a list of explicit steps, each saying what its one batched call posts, which posted
ops it waits for before its compute action, and which after it.  A send sits in a step after
the action that produced it and a recv in the step of the action that consumes it or an
earlier one; see :mod:`~pipeflow.schedules.lowering` for where and why, and for the posting
options (rendezvous, group, at_step, ahead).  The runtime and the simulator interpret the very
same steps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from pipeflow.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"  # input-grad backward; a full backward when no W follows for the same (stage, i)
WEIGHT = "W"  # weight-grad backward, split from B (zero-bubble schedules)
KINDS = (FORWARD, BACKWARD, WEIGHT)

_ACTION_RE = re.compile(r"^(\d+)([FBW])(\d+)$")


class Action(NamedTuple):
    """One compute action: `kind` (F, B or W) of `microbatch` on `stage`; prints as ``1F0``."""

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``'<stage><kind><microbatch>'`` such as ``'1F0'`` back into an Action.

        Raises:
            ScheduleError: if the text is not of that form.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><F|B|W><microbatch>, e.g. '1F0'"
            )
        stage, kind, microbatch = match.groups()
        return cls(kind, int(microbatch), int(stage))


ACTIVATION = "act"
GRADIENT = "grad"


@dataclass(frozen=True)
class CommOp:
    """One point-to-point operation inside a batched call.

    `payload` is ``act`` (outputs of `src_stage` going forward) or ``grad`` (gradients of the
    outputs of `dst_stage` going backward); `peer` is the pipeline rank on the other side.
    """

    op: str  # "send" or "recv"
    payload: str  # ACTIVATION or GRADIENT
    microbatch: int
    src_stage: int
    dst_stage: int
    peer: int

    @property
    def is_send(self) -> bool:
        """True for a send, False for a recv."""
        return self.op == "send"

    def matches(self, other: CommOp) -> bool:
        """True if `other` is the counterpart of this op (same tensor, opposite direction)."""
        return (self.payload, self.microbatch, self.src_stage, self.dst_stage) == (
            other.payload,
            other.microbatch,
            other.src_stage,
            other.dst_stage,
        ) and self.op != other.op

    def describe(self) -> str:
        """Human text such as ``recv activation of micro-batch 5 from stage 2 (rank 2)``."""
        what = "activation" if self.payload == ACTIVATION else "gradient"
        if self.is_send:
            return (
                f"send {what} of micro-batch {self.microbatch} to stage {self.dst_stage} "
                f"(rank {self.peer})"
            )
        return (
            f"recv {what} of micro-batch {self.microbatch} from stage {self.src_stage} "
            f"(rank {self.peer})"
        )

    @property
    def producer(self) -> Action:
        """The action that computes the transferred tensors (F for activations, B for gradients)."""
        return Action(FORWARD if self.payload == ACTIVATION else BACKWARD, self.microbatch, self.src_stage)

    @property
    def consumer(self) -> Action:
        """The action that consumes the transferred tensors (F of the next stage, B of the previous)."""
        return Action(FORWARD if self.payload == ACTIVATION else BACKWARD, self.microbatch, self.dst_stage)

    def __str__(self) -> str:
        arrow = "->" if self.is_send else "<-"
        return f"{self.op}:{self.payload}{self.microbatch}[{self.src_stage}>{self.dst_stage}]{arrow}r{self.peer}"


@dataclass(frozen=True)
class Step:
    """One step of a rank's program, explicit about its communication.

    The step posts `ops` in one batched call, waits for the posted ops in `waits` (ops of this
    step or of earlier ones), runs its compute action (if any), then waits for the ops in
    `after` (sends whose tensors can be freed then).  Every posted op is waited exactly once.
    Left out, `waits` is every op of the step and `after` nothing: rendezvous, the step's batch
    completes before its action.

    `backward_weights` only matters for B actions: True when this B must also accumulate the
    weight gradients (no W action follows for the same stage and micro-batch).

    With sharded parameters (``parallel.shard=full``), once the step's ops are posted, `reshard`
    names the stages done for the pass (their last action ran in an earlier step) whose
    gradients are now reduce-scattered (training) and whose full parameters are freed, and
    `unshard` the stages whose parameters are then all-gathered for this step's action (waited
    for with `waits`): each stage of a rank once per pass, at its first action and at the step
    after its last (:func:`~pipeflow.schedules.lowering.shard_points`).  Both are empty without
    sharding.

    With activations offloaded (``pipeline.offload``, :mod:`~pipeflow.schedules.offload`), `offload`
    names the (stage, micro-batch) groups whose saved activations start going to host memory
    right after this step's action (their F), and `reload` those whose copy back to the device is
    issued when this step starts, before its ops are posted, ahead of their B.  Both are empty
    without it.

    `paired` marks the second step of an overlapped pair (DualPipeV's forward of one micro-batch
    and backward of another, ``pipeline.overlap_pairs``): its action runs interleaved with the
    previous step's, each handing the other the rank at its communication points, so one's
    ``all_to_all`` proceeds while the other computes
    (:func:`~pipeflow.schedules.lowering.pair_steps`).  This step's recvs that its action
    consumes (its `waits`) are posted when the pair starts and waited for when its action first
    computes; its other ops (the first action's sends) are posted as soon as the first action
    ends, and its `after` (with the previous step's) is waited for once both are done.
    """

    ops: tuple[CommOp, ...]
    action: Action | None
    backward_weights: bool = True
    waits: tuple[CommOp, ...] | None = None
    after: tuple[CommOp, ...] = ()
    unshard: tuple[int, ...] = ()
    reshard: tuple[int, ...] = ()
    offload: tuple[tuple[int, int], ...] = ()
    reload: tuple[tuple[int, int], ...] = ()
    paired: bool = False

    def __post_init__(self) -> None:
        if self.waits is None:
            object.__setattr__(self, "waits", self.ops)

    @cached_property
    def action_text(self) -> str:
        """The action as text, ``1F0`` (built once: the runtime names events with it)."""
        return str(self.action) if self.action is not None else ""

    @cached_property
    def ops_text(self) -> str:
        """The step's ops as one line, ``op; op`` (built once: the runtime names events with it)."""
        return "; ".join(str(op) for op in self.ops)

    def __str__(self) -> str:
        ops = " ".join(str(op) for op in self.ops)
        text = f"[{ops}] {self.action if self.action is not None else '-'}"
        if self.unshard:
            text = f"unshard{list(self.unshard)} {text}"
        if self.reload:
            text = f"reload{[f'{s}:{i}' for s, i in self.reload]} {text}"
        if self.offload:
            text = f"{text} offload{[f'{s}:{i}' for s, i in self.offload]}"
        if self.paired:
            text = f"+{text}"
        return f"reshard{list(self.reshard)} {text}" if self.reshard else text


Program = list[Step]


@dataclass
class PipelineSchedule:
    """A schedule: the ordered compute actions of every pipeline rank, plus stage placement.

    Attributes:
        name: the schedule's name (e.g. ``1f1b``).
        num_ranks: p, pipeline ranks.
        num_stages: S, model chunks (S = p * stages per rank).
        num_microbatches: m.
        stage_to_rank: rank that owns each stage, ``stage_to_rank[s]``.
        actions: ``actions[r]`` is rank r's list of actions in execution order.
        training: False for forward-only (evaluation) schedules.
        pairs: ``pairs[r]``, the indices k of rank r's overlapped pairs: ``actions[r][k]`` (an F)
            and ``actions[r][k + 1]`` (a B of another stage and micro-batch) may run interleaved
            (DualPipeV's overlapped forward-backward chunks); empty for other schedules.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]]
    training: bool = True
    pairs: tuple[tuple[int, ...], ...] = ()

    def pairs_of(self, rank: int) -> tuple[int, ...]:
        """The indices of `rank`'s overlapped pairs (see `pairs`)."""
        return self.pairs[rank] if rank < len(self.pairs) else ()

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by `rank`, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def split_backwards(self) -> set[tuple[int, int]]:
        """(stage, micro-batch) of every backward the schedule splits into B and W (its W actions);
        empty when it runs full backwards only."""
        return {(a.stage, a.microbatch) for acts in self.actions for a in acts if a.kind == WEIGHT}

    def table(self) -> str:
        """The schedule as text: one line per rank of actions, e.g. ``0F0 0F1 0B0 ...``."""
        return "\n".join(" ".join(str(a) for a in acts) for acts in self.actions)
