"""Pure schedule generators: (ranks, micro-batches, placement) -> actions per rank.

Each generator returns a :class:`PipelineSchedule`; none touches torch.  Pictures use
F = forward, B = backward; one row per rank, time to the right (p = 4, m = 8 for 1F1B):

    rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    rank 3: F0 B0 F1 B1 F2 B2 ...
"""
from __future__ import annotations

from pipeflow.errors import ScheduleError
from pipeflow.schedules.ir import BACKWARD, FORWARD, Action, PipelineSchedule


def loop_placement(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage s lives on rank s mod p (Megatron's interleaved placement)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def _check(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1:
        raise ScheduleError(f"need at least 1 pipeline rank, got {num_ranks}")
    if num_microbatches < 1:
        raise ScheduleError(
            f"need at least 1 micro-batch, got pipeline.num_microbatches={num_microbatches}"
        )


def gpipe(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank runs all forwards, then all backwards (holds m micro-batches)."""
    _check(num_ranks, num_microbatches)
    m = num_microbatches
    actions = [
        [Action(FORWARD, i, r) for i in range(m)] + [Action(BACKWARD, i, r) for i in range(m)]
        for r in range(num_ranks)
    ]
    return PipelineSchedule("gpipe", num_ranks, num_ranks, m, loop_placement(num_ranks), actions)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): p-r-1 warm-up forwards, then alternate F and B, then drain.

    Rank r holds at most p - r micro-batches' activations.
    """
    _check(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    actions = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(FORWARD, i, r) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(FORWARD, warmup + i, r), Action(BACKWARD, i, r)]
        acts += [Action(BACKWARD, i, r) for i in range(m - warmup, m)]
        actions.append(acts)
    return PipelineSchedule("1f1b", p, p, m, loop_placement(p), actions)


def forward_only(
    num_ranks: int, num_microbatches: int, stage_to_rank: tuple[int, ...] | None = None
) -> PipelineSchedule:
    """Forward passes only (evaluation): each rank runs F for its stages in stage order."""
    _check(num_ranks, num_microbatches)
    owner = stage_to_rank or loop_placement(num_ranks)
    actions: list[list[Action]] = [[] for _ in range(num_ranks)]
    # Micro-batch-major order keeps every rank's forwards in the order its inputs arrive.
    for i in range(num_microbatches):
        for s, r in enumerate(owner):
            actions[r].append(Action(FORWARD, i, s))
    return PipelineSchedule(
        "forward_only", num_ranks, len(owner), num_microbatches, tuple(owner), actions, training=False
    )
