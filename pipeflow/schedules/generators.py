"""Pure schedule generators: (ranks, micro-batches, stages per rank) -> actions per rank.

Each generator returns a :class:`PipelineSchedule`; none touches torch.  Pictures use
F = forward, B = backward; one row per rank, time to the right (p = 4, m = 8 for 1F1B):

    rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    rank 3: F0 B0 F1 B1 F2 B2 ...

Here: GPipe, 1F1B, forward-only, Megatron's interleaved 1F1B and looped BFS (several stages
per rank, loop placement).  The zero-bubble family (B split from W) is in ``zero_bubble.py``;
``docs/schedules/<name>.png`` draws each one (``python -m pipeflow.schedules.show``).
"""
from __future__ import annotations

from pipeflow.errors import ScheduleError
from pipeflow.schedules.interleaved import group_sizes, interleaved_order, one_f_one_b_order
from pipeflow.schedules.ir import BACKWARD, FORWARD, Action, PipelineSchedule
from pipeflow.schedules.registry import ClosedForm, register_schedule


def loop_placement(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage s lives on rank s mod p (Megatron's interleaved placement)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int, stages_per_rank: int = 2) -> tuple[int, ...]:
    """Stages zigzag over the ranks: with 2 per rank, rank r holds stages r and 2p-1-r.

    The first and last stage share rank 0, and the turn (stages p-1, p) is local to rank p-1.
    """
    p = num_ranks
    return tuple(s % p if (s // p) % 2 == 0 else p - 1 - s % p for s in range(p * stages_per_rank))


def _check(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1:
        raise ScheduleError(f"need at least 1 pipeline rank, got {num_ranks}")
    if num_microbatches < 1:
        raise ScheduleError(
            f"need at least 1 micro-batch, got pipeline.num_microbatches={num_microbatches}"
        )


@register_schedule("gpipe", stages_per_rank=1, closed_form=ClosedForm("3(m+p-1)", lambda p, m, v: 3 * (m + p - 1)))
def gpipe(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank runs all forwards, then all backwards (holds m micro-batches)."""
    _check(num_ranks, num_microbatches)
    m = num_microbatches
    actions = [
        [Action(FORWARD, i, r) for i in range(m)] + [Action(BACKWARD, i, r) for i in range(m)]
        for r in range(num_ranks)
    ]
    return PipelineSchedule("gpipe", num_ranks, num_ranks, m, loop_placement(num_ranks), actions)


@register_schedule("1f1b", stages_per_rank=1, closed_form=ClosedForm("3(m+p-1)", lambda p, m, v: 3 * (m + p - 1)))
def one_f_one_b(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): p-r-1 warm-up forwards, then alternate F and B, then drain.

    Rank r holds at most p - r micro-batches' activations.
    """
    _check(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    actions = [one_f_one_b_order([Action(FORWARD, i, r) for i in range(m)], [Action(BACKWARD, i, r) for i in range(m)],
                                 warmup=min(p - r - 1, m)) for r in range(p)]
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


def _check_chunks(name: str, stages_per_rank: int) -> None:
    if stages_per_rank < 1:
        raise ScheduleError(
            f"{name} needs at least 1 stage per rank, got schedule.stages_per_rank={stages_per_rank}"
        )


@register_schedule(
    "interleaved_1f1b",
    stages_per_rank=None,
    closed_form=ClosedForm(
        "3(vm+p-1)+3(v-1)max(0,p-m)", lambda p, m, v: 3 * (v * m + p - 1) + 3 * (v - 1) * max(0, p - m)
    ),
)
def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> PipelineSchedule:
    """Megatron-LM's interleaved 1F1B: v = stages_per_rank chunks per rank, loop placement.

    Micro-batches go through the chunks in groups (of p when p divides m, else as
    :func:`~pipeflow.schedules.interleaved.group_sizes` says, so any m >= 1 works, m < p
    included); the k-th backward walks the chunks in reverse.  Rank r warms up with
    2(p - r - 1) + (v - 1) g forwards, g the first group's size (all of them when m = p), then
    alternates F and B.  With v = 1 this is exactly :func:`one_f_one_b`.  Makespan with unit
    costs 3(vm + p - 1), for every m >= p (multiple of p or not); below p each chunk waits for
    the pipe, 3(v - 1)(p - m) more, as in looped BFS.
    p = 2, v = 2, m = 4 (stages 0, 2 on rank 0; 1, 3 on rank 1):

        rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """
    _check(num_ranks, num_microbatches)
    _check_chunks("interleaved_1f1b", stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if v == 1:
        plain = one_f_one_b(p, m)
        return PipelineSchedule("interleaved_1f1b", p, p, m, plain.stage_to_rank, plain.actions)
    total, first_group = m * v, group_sizes(p, m)[0]
    actions = []
    for r in range(p):
        warmup = total if m == p else min(2 * (p - r - 1) + (v - 1) * first_group, total)
        forwards = interleaved_order(FORWARD, p, m, v, r)
        actions.append(one_f_one_b_order(forwards, interleaved_order(BACKWARD, p, m, v, r), warmup))
    return PipelineSchedule("interleaved_1f1b", p, p * v, m, loop_placement(p, v), actions)


@register_schedule(
    "looped_bfs",
    stages_per_rank=None,
    closed_form=ClosedForm(
        "3(vm+p-1)+3(v-1)max(0,p-m)", lambda p, m, v: 3 * (v * m + p - 1) + 3 * (v - 1) * max(0, p - m)
    ),
)
def looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> PipelineSchedule:
    """Looped BFS (torch.distributed.pipelining's ScheduleLoopedBFS), loop placement.

    Each rank runs every forward of its first stage, then of its next stage, ...; then the
    backwards of its stages in reverse order, micro-batches in reverse order.  Holds v m
    micro-batch activations.
    """
    _check(num_ranks, num_microbatches)
    _check_chunks("looped_bfs", stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    actions = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        acts = [Action(FORWARD, i, s) for s in stages for i in range(m)]
        acts += [Action(BACKWARD, i, s) for s in reversed(stages) for i in reversed(range(m))]
        actions.append(acts)
    return PipelineSchedule("looped_bfs", p, p * v, m, loop_placement(p, v), actions)


def relabel_ranks(schedule: PipelineSchedule, stage_to_rank: tuple[int, ...] | list[int]) -> PipelineSchedule:
    """The same schedule with its ranks renamed so that stage s lives on ``stage_to_rank[s]``.

    An explicit placement (``schedule.stage_to_rank``, e.g. to keep neighbouring stages on one
    node) is usable by a schedule exactly when it renames the schedule's own ranks: every rank
    of the schedule's placement maps to one distinct pipeline rank.  Timing, memory and the
    deadlock-freedom proof are unchanged by a renaming; only which process runs what changes.

    Raises:
        ScheduleError: wrong length, ranks out of range, or a mapping that splits a rank's
            stages (the message shows the placement the schedule needs).
    """
    p, S = schedule.num_ranks, schedule.num_stages
    mapping = tuple(int(r) for r in stage_to_rank)
    own = list(schedule.stage_to_rank)
    if len(mapping) != S:
        raise ScheduleError(
            f"schedule.stage_to_rank has {len(mapping)} entries but schedule {schedule.name!r} has "
            f"{S} stages ({p} ranks x {S // p} per rank); give one rank per stage"
        )
    if any(not 0 <= r < p for r in mapping):
        raise ScheduleError(f"schedule.stage_to_rank={list(mapping)} names ranks outside 0..{p - 1}")
    rename: dict[int, int] = {}
    consistent = all(rename.setdefault(old, new) == new for old, new in zip(own, mapping))
    if not consistent or len(set(rename.values())) != p:
        raise ScheduleError(
            f"schedule.stage_to_rank={list(mapping)} does not fit schedule {schedule.name!r}: it needs "
            f"stages grouped on ranks as {own} (stages sharing a rank there must share one here), "
            f"with every rank used once; e.g. {[(r + 1) % p for r in own]} renames rank r to r+1"
        )
    actions: list[list[Action]] = [[] for _ in range(p)]
    for old, acts in enumerate(schedule.actions):
        actions[rename[old]] = list(acts)
    return PipelineSchedule(schedule.name, p, S, schedule.num_microbatches, mapping, actions, schedule.training)
