"""``schedule=auto`` for a run's layout: the stages' profiled F, B, W costs into the synthesis
(:func:`pipeflow.schedules.synthesize`), and the layout re-predicted for the result.

Every rank derives the same schedule: the profiles are measured on rank 0 and broadcast
(:func:`~pipeflow.planning.layout.choose_layout`), and the synthesis is deterministic.
"""
from __future__ import annotations

from dataclasses import replace

from pipeflow.planning.layout import Layout, predict, stage_bytes
from pipeflow.planning.profile import stage_costs
from pipeflow.schedules import PipelineSchedule, Synthesis, synthesize
from pipeflow.schedules.memory import stage_inflight
from pipeflow.schedules.offload import HostLink, OffloadCosts, group_bytes_of


def auto_for_layout(
    schedule: PipelineSchedule, layout: Layout, max_activations: float | None, placement: str | None,
    comm_s: float = 0.0, offload: tuple[str, HostLink] | None = None,
) -> tuple[PipelineSchedule, Layout, Synthesis]:
    """Synthesise ``auto`` for `layout`'s stages (profiled costs, or F = B = W without profiles).

    Args:
        schedule: the provisional ``auto`` schedule the layout was chosen for (its sizes).
        layout: the run's layout.
        max_activations: ``schedule.max_inflight_microbatches`` (None: p micro-batches, 1F1B's).
        placement: ``schedule.placement`` (None: either).
        comm_s: seconds of one transfer between neighbouring ranks.
        offload: ``pipeline.offload`` and the host link: candidates are judged by what their
            offload plan leaves on the device (needs profiles: without them the activations'
            bytes are unknown and the synthesis counts every micro-batch held).

    Returns:
        The schedule, the layout re-predicted for it (its report holds the synthesis's lines),
        and the synthesis itself.
    """
    p, m = schedule.num_ranks, schedule.num_microbatches
    v = schedule.num_stages // p
    costs = None if layout.profiles is None else stage_costs(layout.ranges, layout.profiles)
    copies = None
    if offload is not None and offload[0] != "none" and layout.profiles is not None:
        held = stage_bytes(layout.ranges, layout.profiles, schedule)
        moved = [c.offloadable for c in held]
        fractions = [min(1.0, o / (c.activations + c.loss)) if c.activations + c.loss > 0 else 0.0
                     for o, c in zip(moved, held)]
        copies = (offload[0], OffloadCosts(group_bytes_of(moved), offload[1]), fractions)
    synthesis = synthesize(p, m, v, costs, comm_s, max_activations, placement, copies)
    chosen = synthesis.chosen.schedule
    basis = "profiled stage costs" if costs is not None else "F = B = W (pipeline.profile=false)"
    note = f"schedule=auto from {basis} ({synthesis.chosen.label}):\n{synthesis.report()}"
    prediction = predict(chosen, layout.ranges, layout.profiles, layout.memory_setting)
    new_layout = replace(layout, inflight=stage_inflight(chosen), prediction=prediction, note=note)
    return chosen, new_layout, synthesis


def auto_for_count(chosen: PipelineSchedule, layout: Layout, count: int, max_activations: float | None,
                   comm_s: float = 0.0) -> PipelineSchedule:
    """``schedule=auto`` synthesised again for `count` micro-batches (``train.batch_ramp``) on the
    stages `chosen` (the run's synthesis) placed: the same placement, so the same stages stay on
    each rank."""
    from pipeflow.schedules.generators import v_placement

    p = chosen.num_ranks
    v = chosen.num_stages // p
    placement = "v" if v > 1 and tuple(chosen.stage_to_rank) == v_placement(p, v) else "loop"
    costs = None if layout.profiles is None else stage_costs(layout.ranges, layout.profiles)
    return synthesize(p, count, v, costs, comm_s, max_activations, placement).chosen.schedule
