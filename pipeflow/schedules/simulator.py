"""The simulator: interprets the lowered programs step by step, exactly as the runtime does
(post a step's ops, wait for its ``waits``, compute, wait for its ``after``), proves them correct
and measures time and memory.

Its parts: :mod:`~pipeflow.schedules.program_checks` (the static checks, before anything runs),
:mod:`~pipeflow.schedules.sim_engine` (the interpretation, :class:`SimResult`,
:class:`RuntimeCosts`) and :mod:`~pipeflow.schedules.deadlock_grid` (the picture of a deadlock);
this module is their entry points.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from pipeflow.errors import ScheduleError
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, PipelineSchedule, Program
from pipeflow.schedules.lowering import lower
from pipeflow.schedules.offload import Group, OffloadCosts, OffloadPlan, plan_offload
from pipeflow.schedules.program_checks import check_channel_counts, check_programs
from pipeflow.schedules.sim_engine import Bucket, Channel, CostFn, RuntimeCosts, SimResult, Simulation, TransferFn

__all__ = ["Bucket", "Channel", "CostFn", "Costs", "DEFAULT_COSTS", "RuntimeCosts", "SimResult", "TransferFn", "simulate",
           "simulated_plan", "validate"]

Costs = Mapping[str, float] | CostFn
DEFAULT_COSTS: dict[str, float] = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}


def simulate(
    schedule: PipelineSchedule,
    programs: list[Program] | None = None,
    costs: Costs | None = None,
    comm_latency: float = 0.0,
    posting: str = "rendezvous",
    microbatch_sizes: Sequence[float] | None = None,
    runtime: RuntimeCosts | None = None,
    shard: bool = False,
    shard_cost: float = 0.0,
    offload: OffloadCosts | None = None,
    overlap: bool = False,
) -> SimResult:
    """Interpret the per-rank programs as the runtime does, checking and measuring them.

    Each step of a rank posts its ops together, waits for its ``waits`` (each op meets its
    counterpart: the k-th send on a directed rank pair meets the k-th recv there), computes,
    then waits for its ``after``.  An op posted at t whose counterpart is posted at t' completes
    at max(t, t') + `comm_latency`; a wait ends when its last op completes.

    Args:
        schedule: the schedule (placement, sizes, training or not).
        programs: per-rank programs; ``lower(schedule, posting)`` when None.
        costs: time per kind (``{"F": 1, "B": 1, "W": 1}`` by default, missing kinds default too)
            or a function of the Action.  A B with ``backward_weights`` costs B + W.
        comm_latency: added to the completion of every op.
        posting: the lowering option when `programs` is None (``rendezvous``, ``group``,
            ``at_step``, ``ahead``; see :mod:`~pipeflow.schedules.lowering`).  The relaxed
            options only post earlier and wait later than rendezvous, so a program that runs
            under rendezvous runs under them too, never later.
        microbatch_sizes: each micro-batch's activation size (variable lengths: its tokens),
            weighing it in ``peak_memory``; default 1 each.
        runtime: the runtime's own costs (per-op transfer, per-step overhead, posting, start
            offsets; :class:`RuntimeCosts`); its ``transfer`` replaces `comm_latency`.
        shard: with `programs` None, lower with shard points (``lower(..., shard=True)``).
        overlap: with `programs` None, lower the schedule's overlapped pairs interleaved
            (``lower(..., overlap=True)``): a pair's actions are timed as the runtime runs them,
            each one's communication (`runtime`'s ``exchanges``) behind the other's compute.
        shard_cost: time of one stage's reduce-scatter and reshard (``reshard``: the rank is
            busy with it right after posting the step's ops) and of one stage's all-gather
            (``unshard``, started after those; the action starts no earlier than its end).
            Programs with shard points are checked: every stage of a rank unsharded once at or
            before its first action and resharded once after its last.
        offload: each group's bytes and the host link (default: the `runtime`'s), timing the programs' offload marks
            (``Step.offload``/``reload``, :mod:`~pipeflow.schedules.offload`): a group's copy to
            the host starts when its F ends and the device-to-host link is free, its copy back
            when its reload step starts (before its ops are posted), the link is free and the
            first copy is done; its B
            starts no earlier than that end.  Copies on a link that is not ``overlapped`` take the
            rank's own time.  None: the marks cost nothing.  Marks are checked: each group
            offloaded at its F, reloaded once after that and at or before its B.

    Returns:
        The :class:`SimResult`.

    Raises:
        ScheduleError: missing, duplicated, misplaced or misordered actions or transfers,
            unmatched comm ops, or a violated data dependency.
        DeadlockError: the programs stop progressing; ``grid`` shows where each rank is stuck.
    """
    if comm_latency < 0:
        raise ScheduleError(f"comm_latency must be >= 0, got {comm_latency}")
    if shard_cost < 0:
        raise ScheduleError(f"shard_cost must be >= 0, got {shard_cost}")
    programs = lower(schedule, posting, shard=shard, overlap=overlap) if programs is None else programs
    check_programs(schedule, programs)
    check_channel_counts(programs)
    sizes = list(microbatch_sizes) if microbatch_sizes is not None else [1.0] * schedule.num_microbatches
    if len(sizes) != schedule.num_microbatches:
        raise ScheduleError(f"got {len(sizes)} micro-batch sizes for {schedule.num_microbatches} micro-batches")
    runtime = runtime or RuntimeCosts()
    if runtime.transfer is None:
        runtime = dataclasses.replace(runtime, transfer=lambda op: comm_latency)
    offload = offload if offload is not None else runtime.offload
    return Simulation(schedule, programs, _cost_function(costs), runtime, sizes, shard_cost, offload).run()


def simulated_plan(
    schedule: PipelineSchedule,
    mode: str,
    offload: OffloadCosts,
    costs: Costs | None = None,
    posting: str = "rendezvous",
    runtime: RuntimeCosts | None = None,
    microbatch_sizes: Sequence[float] | None = None,
    shard: bool = False,
    fits: Callable[[OffloadPlan], bool] | None = None,
) -> OffloadPlan:
    """``pipeline.offload``'s plan (:func:`~pipeflow.schedules.offload.plan_offload`, with its
    memory check `fits`) for the programs ``lower(schedule, posting, shard)`` simulated with these
    costs (as :func:`simulate`)."""

    def run(plan: OffloadPlan) -> tuple[float, list[list[tuple[float, float, float]]], dict[Group, float]]:
        programs = lower(schedule, posting, shard=shard, offload=plan)
        sim = simulate(schedule, programs, costs, posting=posting, microbatch_sizes=microbatch_sizes,
                       runtime=runtime, offload=offload)
        return sim.makespan, sim.step_times, sim.reload_waits

    return plan_offload(schedule, mode, offload, run, fits)


def validate(schedule: PipelineSchedule, programs: list[Program] | None = None, posting: str = "rendezvous") -> SimResult:
    """Prove `programs` (default ``lower(schedule, posting)``) run each action once, in order, no deadlock.

    Programs with overlapped pairs (``Step.paired``) are proved as if every action had a
    communication point, where a pair's B waits for its inputs before its F ends: whatever the
    model, the pair cannot wait on itself.

    Raises:
        ScheduleError: on any problem found (see :func:`simulate`).
        DeadlockError: when the programs cannot make progress.
    """
    paired = programs is not None and any(step.paired for program in programs for step in program)
    return simulate(schedule, programs, posting=posting,
                    runtime=RuntimeCosts(exchanges=lambda action: (0.0, 1)) if paired else None)


def _cost_function(costs: Costs | None) -> CostFn:
    if callable(costs):
        return costs
    table = {**DEFAULT_COSTS, **(costs or {})}
    return lambda action: float(table[action.kind])
