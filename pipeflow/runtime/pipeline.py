"""Executing one rank's lowered program: the only place where communication and compute meet.

For every step of the program: post one batched call (sends of tensors produced by earlier
actions, recvs of tensors needed by this action or a later one; lowering decides which step
carries each transfer), wait for what the action needs, then run the compute action on the
local Stage.  With NCCL that wait is the whole step's group; with gloo, whose ops complete one
by one, it is only the recv of the action's own input.  Arrivals wait in an inbox keyed by
(payload, micro-batch, stage).
Which schedule produced the program is unknown here; the simulator has checked it before.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from pipeflow.runtime.transport import META_LEN, P2PComm, TensorMeta, encode_metas
from pipeflow.runtime import failures
from pipeflow.errors import CommError, PipeflowError, ScheduleError, ShapeMismatchError
from pipeflow.runtime.recv_policy import AheadTuner
from pipeflow.schedules import PipelineSchedule, Program, Step, forward_only, lower
from pipeflow.schedules.ir import ACTIVATION, BACKWARD, FORWARD, GRADIENT, CommOp
from pipeflow.schedules.simulator import validate
from pipeflow.runtime.stage import Stage, Tensors

class TimedEvent(NamedTuple):
    """One recorded interval on this rank: a batched call (kind ``comm``, post to completion)
    or a compute action (kind ``F``, ``B`` or ``W``; name such as ``1F0``); seconds from
    ``time.perf_counter``."""

    kind: str
    name: str
    start: float
    end: float


# inbox/outbox keys: (payload, micro-batch, stage) with stage = receiver (inbox) or sender (outbox)
Key = tuple[str, int, int]


class _InFlight(NamedTuple):
    """A posted recv: its op, the buffers it fills, and the works to wait for."""

    op: CommOp
    tensors: Tensors
    works: list[dist.Work]


class Pipeline:
    """Runs a schedule's program for this rank's stages.

    Args:
        stages: this rank's stages, by stage index.
        schedule: the schedule every rank of the pipeline runs (validated by the simulator).
        comm: the batched P2P communicator of the pipeline group.
        dynamic_shapes: renegotiate shapes whenever the input shape changes (one small
            broadcast per step); otherwise shapes are negotiated once and a change is an error.
        first_timeout_s: deadline for the calls of the first step (shape negotiation included).
    """

    def __init__(
        self,
        stages: dict[int, Stage],
        schedule: PipelineSchedule,
        comm: P2PComm,
        dynamic_shapes: bool = False,
        first_timeout_s: float | None = None,
    ) -> None:
        self.stages = stages
        self.schedule = schedule
        self.comm = comm
        self.rank = comm.rank
        self.dynamic_shapes = dynamic_shapes
        self.first_timeout_s = first_timeout_s
        if comm.size != schedule.num_ranks:
            raise ScheduleError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} pipeline ranks but the "
                f"pipeline group has {comm.size}"
            )
        if sorted(stages) != schedule.stages_of(self.rank):
            raise ScheduleError(
                f"rank {self.rank} holds stages {sorted(stages)} but schedule places "
                f"{schedule.stages_of(self.rank)} on it"
            )
        self.program = self._checked_program(schedule)
        self._eval_programs: dict[int, Program] = {}
        self._edge_meta: dict[int, tuple[TensorMeta, ...]] = {}  # outputs of stage s (edge s -> s+1)
        self._recv_metas: dict[tuple[str, int], tuple[TensorMeta, ...]] = {}  # by (payload, src stage)
        self._input_signature: torch.Tensor | None = None
        self._timeout = first_timeout_s if first_timeout_s is not None else comm.timeout_s
        # When a list, every batched call and compute action of run()/eval() appends a
        # TimedEvent (what observability and the benchmarks read); None records nothing.
        self.events: list[TimedEvent] | None = None
        # Called with a stage index as soon as that stage's weight gradients of the training step
        # are complete (its last full backward or W), e.g. to start its data-parallel all-reduce
        # while the cooldown still runs; None: no call.
        self.on_stage_grads_ready: Callable[[int], None] | None = None
        self._weights_left: dict[int, int] = {}
        # Free a sent activation's storage once sent, keeping its autograd node (the memory
        # benchmark turns it off to show the difference).
        self.free_sent_activations = True
        # True: run exactly the simulator's rendezvous semantics (each step's ops all complete
        # before its action, nothing posted ahead); for debugging and the before/after benchmark.
        self.strict_rendezvous = False
        # gloo (eager runtime) only: post the next step's recvs with this step's sends (True) or
        # each step's recvs with its own sends (False); either way a recv is waited on by the
        # action that consumes it.  "auto" times both over the first training steps and keeps
        # the faster (pipeflow.runtime.recv_policy): ahead hides transfers behind compute, but with tiny
        # layers its early recv-ready messages cost more than they hide (docs/performance.md).
        self.recvs_ahead: bool | str = "auto"
        self.ahead_tuner = AheadTuner()
        # The ranks that agree on auto's choice: this pipeline's (comm.group) by default; the
        # trainer passes the world so that every data-parallel replica makes the same choice.
        self.tuning_group: dist.ProcessGroup | None = comm.group

    @property
    def _eager(self) -> bool:
        """The gloo runtime: ops complete one by one, so recvs are posted ahead and waited on by
        their consumers (not with NCCL's one group per step, nor under strict rendezvous)."""
        return self.comm.independent_ops and not self.strict_rendezvous

    def _tuning(self) -> bool:
        """True while ``recvs_ahead="auto"`` is still timing both settings (eager runtime only)."""
        return self._eager and self.recvs_ahead == "auto" and self.ahead_tuner.choice is None

    def _ahead(self) -> bool:
        """The recvs-ahead setting outside the timed trials: as set, or auto's choice (ahead
        until it is made)."""
        if self.recvs_ahead == "auto":
            return self.ahead_tuner.choice is not False
        return bool(self.recvs_ahead)

    def _checked_program(self, schedule: PipelineSchedule) -> Program:
        programs = lower(schedule)
        validate(schedule, programs)
        return programs[self.rank]

    def _owner(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    # ----------------------------------------------------------------------------- public API
    def run(self, inputs: Sequence[Tensors] | None, targets: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
        """One training step: forward and backward of every micro-batch, grads accumulated.

        Args:
            inputs: the m micro-batch inputs (tuples), needed on the rank holding stage 0.
            targets: the m micro-batch targets, needed on the rank holding the last stage.

        Returns:
            On the rank holding the last stage, the full-batch loss (the micro-batch losses
            each scaled by 1/m and summed); None elsewhere.
        """
        self._negotiate_shapes(inputs)
        m = self.schedule.num_microbatches
        tuning = self._tuning()
        ahead = self.ahead_tuner.next_setting() if tuning else self._ahead()
        start = time.perf_counter()
        self._execute(self.program, inputs, targets, loss_scale=1.0 / m, train=True, ahead=ahead)
        if tuning:
            self.ahead_tuner.record(ahead, time.perf_counter() - start, self.tuning_group, self.comm.device)
        self._timeout = self.comm.timeout_s
        return self._take_loss()

    def eval(
        self,
        inputs: Sequence[Tensors] | None,
        targets: Sequence[torch.Tensor] | None,
        num_microbatches: int | None = None,
    ) -> torch.Tensor | None:
        """Forward-only pass over the micro-batches (no activations kept); returns the loss.

        Args:
            inputs, targets: as for :meth:`run`.
            num_microbatches: how many micro-batches every rank runs (default: the training
                schedule's m); all ranks must pass the same number.
        """
        count = num_microbatches or self.schedule.num_microbatches
        if count not in self._eval_programs:
            schedule = forward_only(self.schedule.num_ranks, count, self.schedule.stage_to_rank)
            self._eval_programs[count] = self._checked_program(schedule)
        self._negotiate_shapes(inputs)
        modes = [(mod, mod.training) for stage in self.stages.values() for mod in stage.module.modules()]
        for stage in self.stages.values():
            stage.module.train(False)  # BatchNorm uses running statistics, dropout is off
        try:
            self._execute(self._eval_programs[count], inputs, targets, loss_scale=1.0 / count, train=False,
                          ahead=self._ahead())
        finally:
            for mod, mode in modes:
                mod.training = mode
        return self._take_loss()

    def _take_loss(self) -> torch.Tensor | None:
        last = self.stages.get(self.schedule.num_stages - 1)
        return None if last is None else last.take_loss()

    # ----------------------------------------------------------------------- shape negotiation
    def _negotiate_shapes(self, inputs: Sequence[Tensors] | None) -> None:
        """Learn the shapes/dtypes crossing every stage boundary (once, or when they change)."""
        if self._edge_meta and not self.dynamic_shapes:
            return
        if self._edge_meta and not self._input_changed(inputs):
            return
        self._edge_meta.clear()
        self._recv_metas.clear()
        S = self.schedule.num_stages
        for s in sorted(self.stages):
            if s == 0:
                in_metas = tuple(TensorMeta.of(t) for t in self._first_input(inputs))
            elif self._owner(s - 1) == self.rank:
                in_metas = self._edge_meta[s - 1]
            else:
                in_metas = self.comm.recv_metas(self._owner(s - 1), f"of stage {s - 1} output")
                self._edge_meta[s - 1] = in_metas
            if s < S - 1:
                self._edge_meta[s] = self._infer_output(self.stages[s], in_metas)
                if self._owner(s + 1) != self.rank:
                    self.comm.send_metas(self._owner(s + 1), self._edge_meta[s], f"of stage {s} output")

    def _first_input(self, inputs: Sequence[Tensors] | None) -> Tensors:
        if not inputs:
            raise ScheduleError(f"rank {self.rank} holds stage 0 but was given no micro-batch inputs")
        return inputs[0]

    def _input_changed(self, inputs: Sequence[Tensors] | None) -> bool:
        """Dynamic shapes: broadcast stage 0's input signature; True if it differs from before."""
        if 0 in self.stages:
            signature = encode_metas([TensorMeta.of(t) for t in self._first_input(inputs)])
        else:
            signature = torch.empty(META_LEN, dtype=torch.int64)
        device_sig = signature.to(self.comm.device)
        dist.broadcast(device_sig, self.comm.global_rank(self._owner(0)), group=self.comm.group)
        signature = device_sig.cpu()
        changed = self._input_signature is None or not torch.equal(signature, self._input_signature)
        self._input_signature = signature
        return changed

    @staticmethod
    def _infer_output(stage: Stage, in_metas: tuple[TensorMeta, ...]) -> tuple[TensorMeta, ...]:
        """The output metadata of `stage` for inputs described by `in_metas`."""
        device = next((p.device for p in stage.parameters()), torch.device("cpu"))
        dummies = tuple(
            torch.zeros(m.shape, dtype=m.dtype, device=device).requires_grad_(m.requires_grad)
            for m in in_metas
        )
        return tuple(TensorMeta.of(t) for t in stage.trial_forward(dummies))

    # -------------------------------------------------------------------------------- execution
    def _execute(
        self,
        program: Program,
        inputs: Sequence[Tensors] | None,
        targets: Sequence[torch.Tensor] | None,
        loss_scale: float,
        train: bool,
        ahead: bool = True,
    ) -> None:
        """Run `program`: per step post its batched call, wait for what the action needs, compute.

        Sends are waited on lazily, after the step's action rather than before it (the sent
        tensors are held until then, then freed).  Where the backend completes ops one by one
        (gloo), the recvs of the next step are posted with this step's sends, before this step
        computes, so data lands while the rank computes (with `ahead`; else each step's recvs go
        with its own sends, see ``recvs_ahead``); and each recv is waited on only by the
        action that consumes it, so a recv that lowering placed before an unrelated action (a W,
        say) never holds that action up.  This is the runtime ``simulate(..., eager_sends=True)``
        proves and times: every op is posted no later than under rendezvous and each wait is for
        a subset of what rendezvous waits for, so nothing can wait longer than in the proven run.
        With NCCL each step is one group on the comm stream, as the simulator runs it.
        """
        inbox: dict[Key, Tensors] = {}
        outbox: dict[Key, Tensors] = {}
        self._weights_left = {s: self.schedule.num_microbatches for s in self.stages} if train else {}
        events, clock = self.events, time.perf_counter
        eager = self._eager
        in_flight: dict[Key, _InFlight] = {}  # eager: posted recvs not waited on yet
        lead = 1 if ahead else 0  # how many steps before its own a step's recvs are posted
        if eager and program and lead:
            self._post_recvs([], program[0], in_flight)
        last = len(program) - 1
        for k, step in enumerate(program):
            t0 = clock()
            sends = self._sends(step, outbox)
            if eager:
                send_works = self._post_recvs(sends, program[k + lead] if k + lead <= last else None, in_flight)
            else:  # the step's own recvs, all waited on before its action (one group with NCCL)
                send_works = self._post_recvs(sends, step, in_flight)
                if self.strict_rendezvous and send_works:
                    self._wait(send_works, program, k)
                    send_works = []
            landed = self._needed(step, in_flight, everything=not eager or k == last)
            for op, tensors, works in landed:
                if works:
                    self._wait(works, program, k, op)
                if op.payload == ACTIVATION:
                    for b, meta in zip(tensors, self._edge_meta[op.src_stage]):
                        b.requires_grad_(meta.requires_grad)
                inbox[(op.payload, op.microbatch, op.dst_stage)] = tensors
            if events is not None and (step.ops or landed):  # a step without ops names what it waited for
                name = step.ops_text or "; ".join(str(entry.op) for entry in landed)
                events.append(TimedEvent("comm", name, t0, clock()))
            if step.action is not None:
                t1 = clock()
                self._compute(step, inbox, outbox, inputs, targets, loss_scale, train)
                if events is not None:
                    events.append(TimedEvent(step.action.kind, str(step.action), t1, clock()))
            if send_works:  # by now the peer has long posted its recvs; `sends` are freed after
                t0 = clock()
                self._wait(send_works, program, k)
                if events is not None:
                    events.append(TimedEvent("comm", "sends of the step done", t0, clock()))
        if inbox or outbox or in_flight:
            left = sorted(inbox) + sorted(outbox) + sorted(in_flight)
            raise ScheduleError(f"rank {self.rank}: program ended with unused transfers {left}")

    def _post_recvs(
        self, sends: list[tuple[int, torch.Tensor]], step: Step | None, in_flight: dict[Key, _InFlight]
    ) -> list[dist.Work]:
        """Post `sends` with the recvs of `step` (None: none) in one batched call, into fresh
        buffers; the recvs join `in_flight` by the inbox key they will fill (with NCCL the
        group's one work goes to the first).  Returns the send works."""
        buffers = [(op, self._recv_buffers(op)) for op in step.ops if not op.is_send] if step is not None else []
        send_works, recv_works = self.comm.post(sends, [(op.peer, b) for op, bs in buffers for b in bs])
        at = 0
        for op, tensors in buffers:
            in_flight[(op.payload, op.microbatch, op.dst_stage)] = _InFlight(op, tensors, recv_works[at : at + len(tensors)])
            at += len(tensors)
        return send_works

    @staticmethod
    def _needed(step: Step, in_flight: dict[Key, _InFlight], everything: bool) -> list[_InFlight]:
        """The in-flight recvs the step's action consumes, or all of them with `everything`."""
        if everything:
            landed = list(in_flight.values())
            in_flight.clear()
            return landed
        action = step.action
        if action is None or action.kind not in (FORWARD, BACKWARD):
            return []
        payload = ACTIVATION if action.kind == FORWARD else GRADIENT
        recv = in_flight.pop((payload, action.microbatch, action.stage), None)
        return [recv] if recv is not None else []

    @staticmethod
    def _describe(k: int, step: Step, op: CommOp | None = None) -> str:
        action = f"before {step.action}" if step.action is not None else "after the last action"
        ops = op.describe() if op is not None else "; ".join(o.describe() for o in step.ops)
        return ops + f" (program step {k}, {action})"

    @staticmethod
    def _sends(step: Step, outbox: dict[Key, Tensors]) -> list[tuple[int, torch.Tensor]]:
        """(peer, tensor) of every send of `step`, taken from the outbox in the step's order."""
        return [
            (op.peer, t) for op in step.ops if op.is_send for t in outbox.pop((op.payload, op.microbatch, op.src_stage))
        ]

    def _wait(self, works: list[dist.Work], program: Program, k: int, op: CommOp | None = None) -> None:
        """Wait for `works` at program step k (those of `op`, or of the step's ops) under the
        deadline; a timeout says what this rank had done before it got stuck."""
        try:
            self.comm.wait(works, lambda: self._describe(k, program[k], op), self._timeout)
        except CommError as exc:
            raise failures.with_progress(exc, program, k)

    def _recv_buffers(self, op: CommOp) -> Tensors:
        metas = self._recv_metas.get((op.payload, op.src_stage))
        if metas is None:
            if op.payload == ACTIVATION:
                metas = self._edge_meta[op.src_stage]
            else:  # gradients of stage dst_stage's outputs that require grad
                metas = tuple(m for m in self._edge_meta[op.dst_stage] if m.requires_grad)
            self._recv_metas[(op.payload, op.src_stage)] = metas
        device = self.comm.device
        return tuple(torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas)

    def _compute(
        self,
        step: Step,
        inbox: dict[Key, Tensors],
        outbox: dict[Key, Tensors],
        inputs: Sequence[Tensors] | None,
        targets: Sequence[torch.Tensor] | None,
        loss_scale: float,
        train: bool,
    ) -> None:
        action = step.action
        assert action is not None
        s, i = action.stage, action.microbatch
        stage = self.stages[s]
        try:
            if action.kind == FORWARD:
                x = inputs[i] if s == 0 and inputs is not None else inbox.pop((ACTIVATION, i, s))
                target = targets[i] if stage.is_last and targets is not None else None
                out = stage.forward(i, x, target, loss_scale, keep_for_backward=train)
                if not stage.is_last:
                    self._check_outputs(s, i, out, train)
                    self._deliver(ACTIVATION, i, s, s + 1, tuple(t.detach() for t in out), inbox, outbox)
                    if train and self.free_sent_activations and self._owner(s + 1) != self.rank:
                        stage.deallocate_outputs(i)  # the sent copy holds the storage until sent
            elif action.kind == BACKWARD:
                grads = None if stage.is_last else inbox.pop((GRADIENT, i, s))
                grads_in = stage.backward(i, grads, weights=step.backward_weights)
                if s > 0:
                    metas = self._edge_meta[s - 1]
                    sent = tuple(
                        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=self.comm.device)
                        for g, m in zip(grads_in, metas)
                        if m.requires_grad
                    )
                    self._deliver(GRADIENT, i, s, s - 1, sent, inbox, outbox)
            else:
                stage.backward_weight(i)
            if action.kind != FORWARD and (action.kind != BACKWARD or step.backward_weights):
                self._weights_done(s)
        except PipeflowError:
            raise
        except Exception as exc:  # a user's layer failed: say where
            where = f"pipeline rank {self.rank}, stage {s}, micro-batch {i}, action {action}"
            raise failures.stage_failure(exc, where, self.stages, self.comm.device) from exc

    def _weights_done(self, s: int) -> None:
        """One more micro-batch's weight gradients of stage s are in; tell the hook after the last."""
        if s not in self._weights_left:
            return
        self._weights_left[s] -= 1
        if self._weights_left[s] == 0 and self.on_stage_grads_ready is not None:
            self.on_stage_grads_ready(s)

    def _deliver(
        self, payload: str, i: int, src: int, dst: int, tensors: Tensors, inbox: dict[Key, Tensors], outbox: dict[Key, Tensors]
    ) -> None:
        """Hand tensors to stage `dst`: directly when it is local, else queue them for sending."""
        if self._owner(dst) == self.rank:
            if payload == ACTIVATION:
                metas = self._edge_meta[src]
                tensors = tuple(t.requires_grad_(m.requires_grad) for t, m in zip(tensors, metas))
            inbox[(payload, i, dst)] = tensors
        else:
            outbox[(payload, i, src)] = tuple(t.contiguous() for t in tensors)

    def _check_outputs(self, s: int, i: int, outputs: Tensors, train: bool) -> None:
        expected = self._edge_meta[s]
        actual = tuple(TensorMeta.of(t) for t in outputs)
        same = len(actual) == len(expected) and all(
            a.shape == e.shape and a.dtype == e.dtype and (a.requires_grad == e.requires_grad or not train)
            for a, e in zip(actual, expected)
        )
        if not same:
            raise ShapeMismatchError(
                f"stage {s} (rank {self.rank}) produced outputs {[str(a) for a in actual]} for "
                f"micro-batch {i}, but stage {s + 1} (rank {self._owner(s + 1)}) expects "
                f"{[str(e) for e in expected]} as negotiated at the first step. Keep every batch "
                f"the same shape (e.g. drop the last partial batch) or set comm.dynamic_shapes=true "
                f"to renegotiate shapes when the input shape changes."
            )
