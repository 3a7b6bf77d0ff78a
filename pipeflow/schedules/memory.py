"""How many micro-batches' activations each stage holds at most under a schedule (no torch)."""
from __future__ import annotations

from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, PipelineSchedule


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
