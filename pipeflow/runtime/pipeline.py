"""Interpreting one rank's lowered program: the only place where communication and compute meet.

For every step of the program: start its reloads (``step.reload``, ``pipeline.offload``), post
its one batched call (``step.ops``), with
``parallel.shard=full`` reduce and free the stages done (``step.reshard``) and start gathering
those starting (``step.unshard``), wait for the posted ops it names (``step.waits``) and the
gathers, run its compute action on the local Stage, then wait for the ops it names after
(``step.after``: sends whose tensors are freed then).  Lowering wrote all of that
into the steps; which lowering runs (rendezvous, NCCL's group, gloo's at_step or ahead) is the
:class:`~pipeflow.runtime.posting.Posting`'s choice, and the simulator has proved each program
before it runs.  An overlapped pair (a step marked ``paired`` and the one before it, DualPipeV's)
runs its two actions interleaved (:mod:`~pipeflow.runtime.overlap`).  Arrivals wait in an inbox
keyed by (payload, micro-batch, stage).  Which schedule produced the program is unknown here.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pipeflow.errors import CommError, PipeflowError, ScheduleError
from pipeflow.runtime import failures, overlap
from pipeflow.runtime.buffers import BufferPool
from pipeflow.runtime.events import D2H, H2D, SHARD, EventRecorder, span
from pipeflow.runtime.parallel.fsdp import FullShard
from pipeflow.runtime.offload import ActivationOffloader, OffloadStats
from pipeflow.runtime.pass_state import Boxes, Key, PassWork, Posted, describe_ops
from pipeflow.runtime.posting import Posting
from pipeflow.runtime.shapes import ShapePlan
from pipeflow.runtime.stage import Stage, Tensors
from pipeflow.runtime.transport import P2PComm
from pipeflow.schedules import PipelineSchedule, Program, Step, forward_only, lower
from pipeflow.schedules.ir import ACTIVATION, BACKWARD, FORWARD, GRADIENT, CommOp
from pipeflow.schedules.lowering import pair_posts
from pipeflow.schedules.offload import OffloadPlan
from pipeflow.schedules.simulator import validate

if TYPE_CHECKING:
    from pipeflow.runtime.memory import MemoryAccountant

class Pipeline:
    """Runs a schedule's program for this rank's stages.

    Args:
        stages: this rank's stages, by stage index.
        schedule: the schedule every rank of the pipeline runs (validated by the simulator).
        comm: the batched P2P communicator of the pipeline group (and its deadlines).
        shapes: how the shapes crossing stage boundaries are learned: ``static`` (once; a change
            is an error), ``per_step`` (again whenever stage 0's input shape changes) or
            ``per_microbatch`` (every pass, each micro-batch its own; see :mod:`~pipeflow.runtime.shapes`).
        posting: which lowering each pass runs (default: ``Posting()``, gloo's ``auto``).
        recorder: where compute actions and batched calls are recorded while it is on.
        on_stage_grads_ready: called with a stage index as soon as that stage's weight
            gradients of the training step are complete (its last full backward or W), e.g. to
            start its data-parallel all-reduce while the cooldown still runs.
        sharding: with ``parallel.shard=full``, the stages' FSDP2 units: the programs are lowered
            with shard points (``Step.unshard``/``reshard``), which gather a stage's parameters
            at its first action of a pass and reduce-scatter its gradients and free them after its
            last (recorded as ``shard`` events).
        offload: ``pipeline.offload``'s plan: the training programs are lowered with its marks
            (``Step.offload``/``reload``) and an :class:`~pipeflow.runtime.offload.ActivationOffloader`
            copies each planned group's saved activations to the host after its F and back from
            its reload step on, its B waiting for the copy (recorded as ``d2h``/``h2d`` events).
        overlap_pairs: run the schedule's overlapped pairs (DualPipeV's, ``schedule.pairs``)
            interleaved (:mod:`~pipeflow.runtime.overlap`; ``pipeline.overlap_pairs``); False runs
            each as its F, then its B.
    """

    def __init__(
        self,
        stages: dict[int, Stage],
        schedule: PipelineSchedule,
        comm: P2PComm,
        shapes: str = "static",
        posting: Posting | None = None,
        recorder: EventRecorder | None = None,
        on_stage_grads_ready: Callable[[int], None] | None = None,
        sharding: FullShard | None = None,
        offload: OffloadPlan | None = None,
        overlap_pairs: bool = True,
    ) -> None:
        self.stages = stages
        self.overlap_pairs = overlap_pairs
        self.pairs = overlap.PairRunner(comm.device)
        self._interleave: bool | None = None  # whether a stage of this rank has a communication point
        self.sharding = sharding
        self.offload = offload if offload is not None and offload.reloads else None
        self.offloader = ActivationOffloader(comm.device) if self.offload is not None else None
        self.offloaded: OffloadStats | None = None  # the last training pass's (None without offloading)
        self._offloaded_groups = self.offload.groups if self.offload is not None else set()
        self.schedule = schedule
        self.comm = comm
        self.rank = comm.rank
        self.posting = posting if posting is not None else Posting()
        self.recorder = recorder if recorder is not None else EventRecorder()
        self.on_stage_grads_ready = on_stage_grads_ready
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
        self._coalescing = not comm.independent_ops
        self.programs = {option: self._checked_program(schedule, option, self.offload)
                         for option in self.posting.options(self._coalescing)}
        self._programs_by_count = {schedule.num_microbatches: (schedule, self.programs)}
        self._mark_split_backward()
        self._eval_programs: dict[tuple[int, str], Program] = {}
        self.shapes = ShapePlan(shapes, stages, schedule, comm, self._stage_failure)
        self.buffers = BufferPool(comm.device)
        self._lent: dict[tuple[int, int], list[torch.Tensor]] = {}  # receive buffers by (stage, micro-batch)
        self._weights_left: dict[int, int] = {}

    def _mark_split_backward(self) -> None:
        """A stage keeps its layers' outputs for backward only where B and W split."""
        for s, stage in self.stages.items():
            stage.split_backward = any(st.action is not None and st.action.stage == s and st.action.kind == BACKWARD
                                       and not st.backward_weights for program in self.programs.values() for st in program)

    def use_schedule(self, schedule: PipelineSchedule) -> None:
        """Run `schedule` from the next step: the same stages on the same ranks, another micro-batch
        count (``train.batch_ramp``); each count's programs are lowered and validated once.

        Raises:
            ScheduleError: another placement of stages, or a pipeline that offloads activations
                (its plan is for one count).
        """
        if schedule.num_microbatches == self.schedule.num_microbatches:
            return
        if list(schedule.stage_to_rank) != list(self.schedule.stage_to_rank):
            raise ScheduleError(f"rank {self.rank}: schedule {schedule.name!r} for {schedule.num_microbatches} "
                                f"micro-batches places stages on ranks {list(schedule.stage_to_rank)}, not "
                                f"{list(self.schedule.stage_to_rank)} as the stages were built")
        if self.offload is not None:
            raise ScheduleError("pipeline.offload plans its copies for one micro-batch count: a run that changes "
                                "its count (train.batch_ramp) cannot offload")
        count = schedule.num_microbatches
        if count not in self._programs_by_count:
            self._programs_by_count[count] = (schedule, {option: self._checked_program(schedule, option)
                                                         for option in self.posting.options(self._coalescing)})
        self.schedule, self.programs = self._programs_by_count[count]
        self._mark_split_backward()

    def _checked_program(self, schedule: PipelineSchedule, posting: str, offload: OffloadPlan | None = None) -> Program:
        programs = lower(schedule, posting, shard=self.sharding is not None, offload=offload,
                         overlap=self.overlap_pairs and schedule.training)
        validate(schedule, programs)
        return programs[self.rank]

    def _owner(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    # ----------------------------------------------------------------------------- public API
    def run(
        self, inputs: Sequence[Tensors] | None, targets: Sequence[torch.Tensor] | None, grad_scale: float = 1.0,
        loss_weights: Sequence[float] | None = None, memory: MemoryAccountant | None = None,
    ) -> torch.Tensor | None:
        """One training step: forward and backward of every micro-batch, grads accumulated.

        Args:
            inputs: the m micro-batch inputs (tuples), needed on the rank holding stage 0.
            targets: the m micro-batch targets, needed on the rank holding the last stage.
            grad_scale: the loss scale (fp16): multiplies the loss that backward starts from,
                not the returned loss.
            loss_weights: what each micro-batch's mean loss is weighted by in the batch's (on
                the last stage's rank): its share of the batch's loss elements, ``n_i / N``;
                default ``1/m`` each (micro-batches alike).
            memory: measure this step's tensor bytes: what autograd saves is tracked and the
                accountant samples after every compute action (see ``pipeflow.runtime.memory``).

        Returns:
            On the rank holding the last stage, the full-batch loss (the micro-batch losses
            each weighted and summed); None elsewhere.
        """
        self._prepare_shapes(inputs, self.schedule.num_microbatches)
        option = self.posting.for_training(self._coalescing)
        start = time.perf_counter()
        m = self.schedule.num_microbatches
        with memory.tracking() if memory is not None else contextlib.nullcontext():
            self._execute(self.programs[option], inputs, targets, True, loss_weights or [1.0 / m] * m, grad_scale,
                          memory)
        self.posting.record(option, time.perf_counter() - start, self._coalescing, self.comm.group, self.comm.device)
        return self._take_loss()

    def eval(
        self,
        inputs: Sequence[Tensors] | None,
        targets: Sequence[torch.Tensor] | None,
        num_microbatches: int | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> torch.Tensor | None:
        """Forward-only pass over the micro-batches (no activations kept); returns the loss.

        Args:
            inputs, targets, loss_weights: as for :meth:`run`.
            num_microbatches: how many micro-batches every rank runs (default: the training
                schedule's m); all ranks must pass the same number.
        """
        count = num_microbatches or self.schedule.num_microbatches
        key = (count, self.posting.for_eval(self._coalescing))
        if key not in self._eval_programs:
            schedule = forward_only(self.schedule.num_ranks, count, self.schedule.stage_to_rank)
            self._eval_programs[key] = self._checked_program(schedule, key[1])
        self._prepare_shapes(inputs, count)
        modes = [(mod, mod.training) for stage in self.stages.values() for mod in stage.module.modules()]
        for stage in self.stages.values():
            stage.module.train(False)  # BatchNorm uses running statistics, dropout is off
        try:
            self._execute(self._eval_programs[key], inputs, targets, False, loss_weights or [1.0 / count] * count)
        finally:
            for mod, mode in modes:
                mod.training = mode
        return self._take_loss()

    def comm_tensors(self, boxes: Boxes | None = None) -> list[torch.Tensor]:
        """The transport's buffers now: the receive pool's free buffers, those lent to
        micro-batches and, during a pass, the tensors queued for sending or posted."""
        tensors = self.buffers.free_buffers() + [t for ts in self._lent.values() for t in ts]
        return tensors + (boxes.tensors() if boxes is not None else [])

    def _prepare_shapes(self, inputs: Sequence[Tensors] | None, count: int) -> None:
        """Learn the pass's shapes; sharded stages are gathered first whenever the shape plan may
        run trial forwards (the first pass, or every pass unless shapes are static: a rule every
        dp replica follows alike, as the gathers are collective), and stay gathered into the pass."""
        if self.sharding is not None and (self.shapes.mode != "static" or not self.shapes.edges):
            self.sharding.unshard_all()
        self.shapes.prepare(inputs, count)

    def _take_loss(self) -> torch.Tensor | None:
        last = self.stages.get(self.schedule.num_stages - 1)
        return None if last is None else last.take_loss()

    # -------------------------------------------------------------------------------- execution
    def _execute(
        self,
        program: Program,
        inputs: Sequence[Tensors] | None,
        targets: Sequence[torch.Tensor] | None,
        train: bool,
        loss_weights: Sequence[float],
        grad_scale: float = 1.0,
        memory: MemoryAccountant | None = None,
    ) -> None:
        """Interpret `program`: per step post its ops, wait for its waits, compute, wait for its after.

        Micro-batch i's loss is weighted by ``loss_weights[i]``, so the summed loss and gradients
        are those of the full batch.
        """
        self._weights_left = {s: self.schedule.num_microbatches for s in self.stages} if train else {}
        recorder = self.recorder if self.recorder.on else None  # marks: perf_counter, or CUDA events
        boxes, work = Boxes(), PassWork(inputs, targets, loss_weights, train, grad_scale)
        for k, step in enumerate(program):
            if step.paired:  # ran with the step before it
                continue
            paired = k + 1 < len(program) and program[k + 1].paired
            self._open(k, step, program, boxes, train, recorder)
            if paired:
                self._run_pair(k, program, boxes, work, recorder)
            else:
                self._act(step, boxes, work, recorder)
            if memory is not None and step.action is not None:  # after the recorder: the action's time does not include it
                memory.sample(self.comm_tensors(boxes), (inputs, targets),
                              self.offloader.device_tensors() if self.offloader is not None else ())
            if not paired:  # after the sample: the F's activations are on the device until copied
                self._offload(step, recorder)
            self._close(k + paired, program, boxes, recorder)
        for key in list(self._lent):  # evaluation's, and any a pass left
            self.buffers.give(self._lent.pop(key))
        self.buffers.end_pass()
        if train and self.offloader is not None:
            self.offloaded = self.offloader.end_pass()
        left = boxes.left()
        if left:
            raise ScheduleError(f"rank {self.rank}: program ended with unused transfers {left}")

    def _open(self, k: int, step: Step, program: Program, boxes: Boxes, train: bool,
              recorder: EventRecorder | None) -> None:
        """Step k up to its action: its reloads, its ops posted, shard points, its waits."""
        self._reload(step.reload, recorder)  # first: each B waits for its own copy, which runs beside what follows
        t0 = recorder.mark() if recorder is not None else None
        self._post(step.ops, step, boxes, program, k)
        gathers = ()
        if step.unshard or step.reshard:  # the shard points' own events: the comm event restarts after them
            if recorder is not None and step.ops:
                recorder.record("comm", step.ops_text, t0, recorder.mark())
            gathers = self._shard_points(step, train, recorder)
            t0 = recorder.mark() if recorder is not None else None
        self._wait(step.waits, boxes, program, k)
        if recorder is not None and (step.ops or step.waits):  # a step that posts nothing names what it waited for
            recorder.record("comm", step.ops_text or "; ".join(str(op) for op in step.waits), t0, recorder.mark())
        if gathers:
            with span(recorder, SHARD, f"unshard {','.join(map(str, step.unshard))}"):
                self.sharding.wait(gathers)

    def _act(self, step: Step, boxes: Boxes, work: PassWork, recorder: EventRecorder | None) -> None:
        """The step's action, recorded."""
        if step.action is not None:
            with span(recorder, step.action.kind, step.action_text):
                self._compute(step, boxes, work)

    def _offload(self, step: Step, recorder: EventRecorder | None) -> None:
        """Start copying to the host the activations of the groups the step offloads (its F's)."""
        for s, i in step.offload:
            with span(recorder, D2H, f"offload {s}:{i}"):
                self.offloader.offload((s, i), self.stages[s].kept_tensors(i))

    def _run_pair(self, k: int, program: Program, boxes: Boxes, work: PassWork, recorder: EventRecorder | None) -> None:
        """Steps k and k + 1, an overlapped pair (``Step.paired``): the B's reloads and the recvs
        it consumes posted now, then the F here and the B on the pair's worker thread, one
        computing at a time and handing over at their communication points; the F's sends are
        posted as soon as it ends, the B waits for its recvs when it first computes."""
        step, second = program[k], program[k + 1]
        self._reload(second.reload, recorder)
        early, late = pair_posts(second)
        self._post(early, second, boxes, program, k + 1)

        def forward() -> None:
            self._act(step, boxes, work, recorder)
            self._offload(step, recorder)
            self._post(late, second, boxes, program, k + 1)

        def backward() -> None:
            with span(recorder if second.waits else None, "comm", "; ".join(map(str, second.waits))):
                self._wait(second.waits, boxes, program, k + 1)
            self._act(second, boxes, work, recorder)

        if self._interleave is None:  # at the first pair: after the experts were split (run start)
            self._interleave = overlap.communicates(stage.module for stage in self.stages.values())
        self.pairs.run(forward, backward, self._interleave)

    def _close(self, k: int, program: Program, boxes: Boxes, recorder: EventRecorder | None) -> None:
        """Step k's ``after``: by now the peer has long posted its recvs; the sent tensors are freed."""
        if program[k].after:
            with span(recorder, "comm", "sends of the step done"):
                self._wait(program[k].after, boxes, program, k, after=True)

    def _reload(self, groups: tuple[tuple[int, int], ...], recorder: EventRecorder | None) -> None:
        """Start copying back the offloaded `groups` (each an ``h2d`` event)."""
        for s, i in groups:
            with span(recorder, H2D, f"reload {s}:{i}"):
                self.offloader.reload((s, i))

    def _shard_points(self, step: Step, train: bool, recorder: EventRecorder | None) -> list:
        """Reduce and free the stages done (``step.reshard``), then start gathering the stages this
        step's action needs (``step.unshard``); returns the gathers to wait for before it."""
        assert self.sharding is not None
        if step.reshard:
            what = "reduce-scatter + reshard" if train else "reshard"
            with span(recorder, SHARD, f"{what} {','.join(map(str, step.reshard))}"):
                self.sharding.reshard(step.reshard, train)
        return self.sharding.unshard(step.unshard) if step.unshard else []

    def _post(self, ops: tuple[CommOp, ...], step: Step, boxes: Boxes, program: Program, k: int) -> None:
        """Post `ops` (step k's) in one batched call: sends from the outbox, recvs into fresh buffers
        (a peer found dead while posting is a CommError naming the ops and this rank's progress)."""
        if not ops:
            return
        tensors = [
            boxes.outbox.pop((op.payload, op.microbatch, op.src_stage)) if op.is_send else self._recv_buffers(op)
            for op in ops
        ]
        sends = [(op.peer, t) for op, ts in zip(ops, tensors) if op.is_send for t in ts]
        recvs = [(op.peer, t) for op, ts in zip(ops, tensors) if not op.is_send for t in ts]
        try:
            works = self.comm.post(sends, recvs, lambda: self._describe(k, step, ops, False) + ", when posting them")
        except CommError as exc:
            raise failures.with_progress(exc, program, k)
        sent_works, recv_works = works[: len(sends)], works[len(sends):]
        mark = self.recorder.mark() if self.recorder.on else None  # the transfers' start (stragglers)
        for op, ts in zip(ops, tensors):
            pool = sent_works if op.is_send else recv_works
            boxes.posted[op] = Posted(ts, pool[: len(ts)], mark)
            del pool[: len(ts)]

    def _wait(self, ops: tuple[CommOp, ...], boxes: Boxes, program: Program, k: int, after: bool = False) -> None:
        """Wait for posted `ops` under the deadline; received tensors go to the inbox."""
        if not ops:
            return
        entries = [boxes.posted.pop(op) for op in ops]
        waited = self.recorder.mark() if self.recorder.on else None
        try:
            self.comm.wait([w for entry in entries for w in entry.works], lambda: self._describe(k, program[k], ops, after))
        except CommError as exc:
            raise failures.with_progress(exc, program, k)
        if waited is not None:
            done = self.recorder.mark()
            for op, entry in zip(ops, entries):
                if entry.mark is not None:
                    self.recorder.record_transfer(str(op), sum(t.numel() * t.element_size() for t in entry.tensors),
                                                  entry.mark, waited, done)
        for op, entry in zip(ops, entries):
            if op.is_send:
                continue
            tensors = entry.tensors
            if op.payload == ACTIVATION:
                tensors = self._as_inputs(op.src_stage, op.microbatch, tensors)
            boxes.inbox[(op.payload, op.microbatch, op.dst_stage)] = tensors

    def _describe(self, k: int, step: Step, ops: tuple[CommOp, ...], after: bool) -> str:
        return describe_ops(k, step, ops, after, self.comm.global_rank)

    def _recv_buffers(self, op: CommOp) -> Tensors:
        """Pooled buffers for what `op` receives, lent to its stage and micro-batch until released."""
        if op.payload == ACTIVATION:
            metas = self.shapes.metas(op.src_stage, op.microbatch)
        else:  # gradients of stage dst_stage's outputs that require grad
            metas = self.shapes.grad_metas(op.dst_stage, op.microbatch)
        tensors = tuple(self.buffers.take(m) for m in metas)
        self._lent.setdefault((op.dst_stage, op.microbatch), []).extend(tensors)
        return tensors

    def _stage_failure(self, exc: BaseException, where: str) -> Exception:
        return failures.stage_failure(exc, where, self.stages, self.comm.device)

    def _compute(self, step: Step, boxes: Boxes, work: PassWork) -> None:
        """The step's action on its local stage: what it consumes taken from the inbox, what it
        makes handed to the next stage or queued in the outbox."""
        action = step.action
        inbox, outbox, train = boxes.inbox, boxes.outbox, work.train
        assert action is not None
        s, i = action.stage, action.microbatch
        stage = self.stages[s]
        try:
            if action.kind == FORWARD:
                x = work.inputs[i] if s == 0 and work.inputs is not None else inbox.pop((ACTIVATION, i, s))
                target = work.targets[i] if stage.is_last and work.targets is not None else None
                with self._saving(step, stage, x):
                    out = stage.forward(i, x, target, work.loss_weights[i], keep_for_backward=train,
                                        grad_scale=work.grad_scale)
                if not stage.is_last:
                    self.shapes.check(s, i, out, train)
                    self._deliver(ACTIVATION, i, s, s + 1, tuple(t.detach() for t in out), inbox, outbox)
                    if train and self._owner(s + 1) != self.rank:
                        stage.deallocate_outputs(i)  # the sent copy holds the storage until sent
            elif action.kind == BACKWARD:
                grads = None if stage.is_last else inbox.pop((GRADIENT, i, s))
                if (s, i) in self._offloaded_groups:
                    self.offloader.ready((s, i))
                grads_in = stage.backward(i, grads, weights=step.backward_weights)
                if s > 0:
                    sent = tuple(
                        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=self.comm.device)
                        for g, m in zip(grads_in, self.shapes.metas(s - 1, i))
                        if m.requires_grad
                    )
                    self._deliver(GRADIENT, i, s, s - 1, sent, inbox, outbox)
            else:
                stage.backward_weight(i)
            if action.kind != FORWARD and (action.kind != BACKWARD or step.backward_weights):
                self._weights_done(s)
                self.buffers.give(self._lent.pop((s, i), ()))  # its last backward: nothing reads them now
                if (s, i) in self._offloaded_groups:
                    self.offloader.release((s, i))
        except PipeflowError:
            raise
        except Exception as exc:  # a user's layer failed: say where
            where = f"pipeline rank {self.rank}, stage {s}, micro-batch {i}, action {action}"
            raise self._stage_failure(exc, where) from exc

    def _saving(self, step: Step, stage: Stage, inputs: Tensors) -> contextlib.AbstractContextManager:
        """Around an offloaded group's F: what autograd saves goes to the offloader (never the
        stage's parameters, buffers or this micro-batch's inputs)."""
        if not step.offload:
            return contextlib.nullcontext()
        keep = [*stage.module.parameters(), *stage.module.buffers(), *inputs]
        return self.offloader.saving(step.offload[0], keep)

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
                tensors = self._as_inputs(src, i, tensors)
            inbox[(payload, i, dst)] = tensors
        else:
            outbox[(payload, i, src)] = tuple(t.contiguous() for t in tensors)

    def _as_inputs(self, src: int, i: int, tensors: Tensors) -> Tensors:
        """Stage `src`'s outputs for micro-batch i as the next stage's inputs: requiring grad
        where the shape plan says (received or handed over on this rank)."""
        return tuple(t.requires_grad_(m.requires_grad) for t, m in zip(tensors, self.shapes.metas(src, i)))
