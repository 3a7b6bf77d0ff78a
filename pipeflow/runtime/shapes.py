"""What crosses every stage boundary, per micro-batch: the shapes and dtypes every recv is posted with.

A receive must be posted with its size (NCCL counts exactly), so before a pass every rank learns
the tensor metadata of each stage boundary it receives on.  The metadata flows down the stages as
the data will: stage 0's rank reads it off the micro-batch inputs, each stage derives its outputs'
metadata from its inputs' by one trial forward per distinct input signature (cached), and a rank
whose next stage lives elsewhere sends it there in one small point-to-point message per stage
boundary (never a collective; it runs before any of the pass's transfers, in stage order, so it
cannot interleave with them).  Three modes:

- ``static``: learned at the first pass, for one micro-batch (all alike); a later change is an
  error that names both stages.
- ``per_step`` (``comm.shapes=per_step``): relearned whenever stage 0's input signature changes
  between passes (one small broadcast per pass says whether it did); micro-batches of a pass alike.
- ``per_microbatch`` (``comm.shapes=per_microbatch``): every pass, the metadata of each of its
  micro-batches flows down the stages (one message of ``m x META_LEN`` int64 per stage boundary);
  micro-batches may differ in every dimension.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pipeflow.errors import ConfigError, PipeflowError, ScheduleError, ShapeMismatchError
from pipeflow.runtime.stage import Stage, Tensors
from pipeflow.runtime.transport import META_LEN, P2PComm, TensorMeta, encode_metas
from pipeflow.schedules import PipelineSchedule

SHAPE_MODES = ("static", "per_step", "per_microbatch")  # the words of comm.shapes
Metas = tuple[TensorMeta, ...]


class ShapePlan:
    """The metadata of every stage boundary this rank touches, for each micro-batch of a pass.

    Args:
        mode: one of :data:`SHAPE_MODES` (module docstring).
        stages: this rank's stages, by index.
        schedule: the schedule (placement of stages on ranks).
        comm: the pipeline's transport.
        failure: turns an exception of a user's layer during the trial forward into the error to
            raise, given where it happened.
    """

    def __init__(
        self, mode: str, stages: dict[int, Stage], schedule: PipelineSchedule, comm: P2PComm,
        failure: Callable[[BaseException, str], Exception],
    ) -> None:
        if mode not in SHAPE_MODES:
            raise ConfigError(f"unknown shape mode {mode!r}; valid: {', '.join(SHAPE_MODES)}")
        self.mode, self.stages, self.schedule, self.comm, self.failure = mode, stages, schedule, comm, failure
        self.rank = comm.rank
        self.edges: dict[int, list[Metas]] = {}  # outputs of stage s (edge s -> s+1): per micro-batch, or one for all
        self._outputs: dict[tuple[int, Metas], Metas] = {}  # stage s's output metadata by input metadata
        self._signature: torch.Tensor | None = None

    def prepare(self, inputs: Sequence[Tensors] | None, count: int) -> None:
        """Learn the metadata for a pass of `count` micro-batches (collective over the pipeline)."""
        if self.mode == "per_microbatch":
            self._learn(inputs, count)
        elif not self.edges or (self.mode == "per_step" and self._input_changed(inputs)):
            self._learn(inputs, 1)

    def metas(self, edge: int, i: int) -> Metas:
        """The outputs of stage `edge` (what crosses edge -> edge + 1) for micro-batch `i`."""
        plan = self.edges[edge]
        return plan[i] if len(plan) > 1 else plan[0]

    def grad_metas(self, edge: int, i: int) -> Metas:
        """The gradients that cross edge + 1 -> edge for micro-batch `i`: those of the outputs that require grad."""
        return tuple(m for m in self.metas(edge, i) if m.requires_grad)

    def check(self, s: int, i: int, outputs: Tensors, train: bool) -> None:
        """Raise ShapeMismatchError unless stage s's outputs for micro-batch i are what the plan says."""
        expected = self.metas(s, i)
        actual = tuple(TensorMeta.of(t) for t in outputs)
        same = len(actual) == len(expected) and all(
            a.shape == e.shape and a.dtype == e.dtype and (a.requires_grad == e.requires_grad or not train)
            for a, e in zip(actual, expected)
        )
        if same:
            return
        if self.mode == "per_microbatch":
            how = ("as its trial forward gave for the same input shapes: a stage's output shapes must be a "
                   "function of its input shapes")
        else:
            how = ("as negotiated at the first step. Keep every batch the same shape (e.g. drop the last partial "
                   "batch), set comm.shapes=per_step to renegotiate shapes when the input shape changes, or "
                   "comm.shapes=per_microbatch for micro-batches that differ in shape")
        raise ShapeMismatchError(
            f"stage {s} (rank {self.rank}) produced outputs {[str(a) for a in actual]} for micro-batch {i}, but "
            f"stage {s + 1} (rank {self._owner(s + 1)}) expects {[str(e) for e in expected]} {how}."
        )

    def _owner(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    def _learn(self, inputs: Sequence[Tensors] | None, count: int) -> None:
        self.edges.clear()
        last = self.schedule.num_stages - 1
        for s in sorted(self.stages):
            if s == 0:
                plan = [tuple(TensorMeta.of(t) for t in mb) for mb in self._first_inputs(inputs, count)]
            elif self._owner(s - 1) == self.rank:
                plan = self.edges[s - 1]
            else:
                plan = self.comm.recv_metas(self._owner(s - 1), count, f"of stage {s - 1} output")
                self.edges[s - 1] = plan
            if s < last:
                self.edges[s] = [self._output(s, metas, i) for i, metas in enumerate(plan)]
                if self._owner(s + 1) != self.rank:
                    self.comm.send_metas(self._owner(s + 1), self.edges[s], f"of stage {s} output")

    def _first_inputs(self, inputs: Sequence[Tensors] | None, count: int) -> Sequence[Tensors]:
        if not inputs or len(inputs) < count:
            got = len(inputs) if inputs else 0
            raise ScheduleError(f"rank {self.rank} holds stage 0 but was given {got} micro-batch inputs, not {count}")
        return inputs[:count]

    def _output(self, s: int, in_metas: Metas, i: int) -> Metas:
        """Stage s's output metadata for inputs described by `in_metas`, those of micro-batch `i`
        (one trial forward per signature)."""
        key = (s, in_metas)
        if key not in self._outputs:
            stage = self.stages[s]
            device = next((p.device for p in stage.parameters()), self.comm.device)
            dummies = tuple(
                torch.zeros(m.shape, dtype=m.dtype, device=device).requires_grad_(m.requires_grad) for m in in_metas
            )
            try:
                outputs = stage.trial_forward(dummies)
            except PipeflowError:
                raise
            except Exception as exc:  # a user's layer failed on these shapes: say where
                where = (f"pipeline rank {self.rank}, stage {s}, shape negotiation (a trial forward on zeros "
                         f"shaped like micro-batch {i}: {[str(m) for m in in_metas]})")
                raise self.failure(exc, where) from exc
            self._outputs[key] = tuple(TensorMeta.of(t) for t in outputs)
        return self._outputs[key]

    def _input_changed(self, inputs: Sequence[Tensors] | None) -> bool:
        """Dynamic mode: broadcast stage 0's input signature; True if it differs from the last pass's."""
        if 0 in self.stages:
            signature = encode_metas([TensorMeta.of(t) for t in self._first_inputs(inputs, 1)[0]])
        else:
            signature = torch.empty(META_LEN, dtype=torch.int64)
        device_sig = signature.to(self.comm.device)
        dist.broadcast(device_sig, self.comm.global_rank(self._owner(0)), group=self.comm.group)
        signature = device_sig.cpu()
        changed = self._signature is None or not torch.equal(signature, self._signature)
        self._signature = signature
        return changed
