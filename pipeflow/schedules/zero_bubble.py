"""Zero-bubble schedules: backward split into B (input grads) and W (weight grads).

From Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), and DeepSeek's DualPipeV
(the V-shaped cut of DualPipe, DeepSeek-V3 report).  A W has no consumer on another stage, so
it can wait: deferred Ws fill the bubbles that 1F1B leaves.  Pure functions, no torch.
"""
from __future__ import annotations

from pipeflow.errors import ScheduleError
from pipeflow.schedules.generators import _check, loop_placement, one_f_one_b, v_placement
from pipeflow.schedules.interleaved import group_sizes, interleaved_order
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action, PipelineSchedule
from pipeflow.schedules.registry import ClosedForm, register_schedule


@register_schedule(
    "zb_h1",
    stages_per_rank=1,
    closed_form=ClosedForm("3m+p-1 (m>=p)", lambda p, m, v: 3 * m + p - 1 if m >= p else 2 * (m + p) - 1),
)
def zb_h1(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """ZB-H1: 1F1B whose weight-grad passes are deferred to fill the cool-down bubble.

    Rank r warms up with p - r - 1 forwards like 1F1B, then alternates F and B; its first r
    Ws are held back and every later B is followed by the oldest pending W; the held-back Ws
    run at the end, where 1F1B idles.  With F = B = W = 1 the idle time is (p - 1) per rank,
    a third of 1F1B's 3 (p - 1), once m >= p.  Every rank holds up to min(p, m) micro-batches
    between F and W (1F1B's peak on rank 0), as the paper's ZB-H1 does.  p = 3, m = 4:

        rank 0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
        rank 1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3
        rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3
    """
    p, m = num_ranks, num_microbatches
    actions = []
    for r, order in enumerate(one_f_one_b(p, m).actions):  # checks p and m
        acts, pending = [], []
        for action in order:  # 1F1B's order, each B i followed by the oldest pending W once i >= r
            acts.append(action)
            if action.kind == BACKWARD:
                pending.append(action.microbatch)
                if action.microbatch >= r:
                    acts.append(Action(WEIGHT, pending.pop(0), r))
        actions.append(acts + [Action(WEIGHT, i, r) for i in pending])
    return PipelineSchedule("zb_h1", p, p, m, loop_placement(p), actions)


class _Counter:
    """Hands out the next micro-batch of each (kind, stage) for one rank's action list."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}

    def add(self, kind: str, stage: int) -> int:
        i = self.next.get((kind, stage), 0)
        self.next[kind, stage] = i + 1
        self.actions.append(Action(kind, i, stage))
        return i

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)


@register_schedule(
    "zbv",
    stages_per_rank=2,
    placements=("v",),
    closed_form=ClosedForm("max(6m+p-1, 4m+4p-2)", lambda p, m, v: max(6 * m + p - 1, 4 * m + 4 * p - 2)),
)
def zbv(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """ZB-V: V placement (rank r holds stages r and 2p-1-r), B/W split, as torch's ScheduleZBVZeroBubble.

    Rank r: 2(p - r) - 1 forwards of its first stage; r pairs (F second stage, F first stage);
    p - r rounds of (F, B, W) on its second stage; then the steady state alternates
    (F, B, W) on the first stage and on the second; the cool-down runs the remaining Bs and
    fills the tail with Ws.  Micro-batches past m are dropped, so any m >= 1 works.  With
    F = B = W = 1 the makespan is max(6m + p - 1, 4m + 4p - 2): for m >= (3p - 1) / 2 the
    lower bound of any V-placed schedule (rank p - 1 cannot start before p - 1 and has 6m of
    work).  p = 2, m = 4 (stages 0, 3 on rank 0; 1, 2 on rank 1):

        rank 0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 ...
        rank 1: 1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 ...
    """
    _check(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    n = max(2 * p - 1, m)  # the pattern needs 2p - 1 micro-batches to fill the pipe
    actions = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        ops = _Counter()
        for _ in range(2 * (p - r) - 1):
            ops.add(FORWARD, first)
        for _ in range(r):
            ops.add(FORWARD, second)
            ops.add(FORWARD, first)
        for _ in range(p - r):
            ops.add(FORWARD, second)
            ops.add(BACKWARD, second)
            ops.add(WEIGHT, second)
        while ops.count(FORWARD, second) < ops.count(FORWARD, first) or ops.count(FORWARD, first) < n:
            if ops.count(FORWARD, first) < n:
                ops.add(FORWARD, first)
            ops.add(BACKWARD, first)
            ops.add(WEIGHT, first)
            ops.add(FORWARD, second)
            ops.add(BACKWARD, second)
            ops.add(WEIGHT, second)
        for _ in range(r):
            ops.add(BACKWARD, first)
            ops.add(BACKWARD, second)
        for _ in range(p - r):
            ops.add(BACKWARD, first)
            ops.add(WEIGHT, first)
        for stage in (second, first):
            while ops.count(WEIGHT, stage) < ops.count(BACKWARD, stage):
                ops.add(WEIGHT, stage)
        actions.append([a for a in ops.actions if a.microbatch < m])
    return PipelineSchedule("zbv", p, 2 * p, m, v_placement(p), actions)


@register_schedule(
    "dualpipev",
    stages_per_rank=2,
    placements=("v",),
    closed_form=ClosedForm(
        "6m+p-1+min(p-1,(m-p)//2)", lambda p, m, v: 6 * m + p - 1 + min(p - 1, (m - p) // 2)
    ),
)
def dualpipev(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """DeepSeek's DualPipeV: V placement, 2 stages per rank, overlapped forward-backward pairs.

    Rank r holds stages r (first) and 2p-1-r (second).  Phases, as in DeepSeek's reference:
    2(p - r - 1) forwards of the first stage; r + 1 pairs of forwards (first, second);
    p - r - 1 rounds (B second, W, F second); the main phase of overlapped pairs
    "F first + B second" and "F second + B first" (each an overlapped pair: an F then a full B
    of another stage and micro-batch, marked in ``pairs`` for the runtime to run interleaved,
    ``pipeline.overlap_pairs``); p - r - 1 rounds (B second, the pair F second + B first);
    r + 1 rounds of Bs on both stages (the later half split into B and W); p - r - 1 rounds
    (W, B first); the remaining Ws.  With F = B = W = 1 (full B = 2) the makespan is
    6m + p - 1 + min(p - 1, (m - p) // 2) under rendezvous, 6m + p - 1 if sends never waited.

    Raises:
        ScheduleError: when m < 2p (the warm-up alone needs 2p micro-batches).
    """
    _check(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev needs at least 2p = {2 * p} micro-batches for {p} pipeline ranks "
            f"(valid pipeline.num_microbatches: {2 * p}, {2 * p + 1}, ...), got {m}"
        )
    ranks = [_dualpipev_rank(p, m, r) for r in range(p)]
    return PipelineSchedule("dualpipev", p, 2 * p, m, v_placement(p), [actions for actions, _ in ranks],
                            pairs=tuple(pairs for _, pairs in ranks))


def _dualpipev_rank(p: int, m: int, r: int) -> tuple[list[Action], tuple[int, ...]]:
    """Rank r's actions and the indices of its overlapped pairs (each an F then a full B)."""
    first, second = r, 2 * p - 1 - r
    ops = _Counter()
    pairs: list[int] = []
    deferred: list[tuple[int, int]] = []  # (stage, micro-batch) of Bs whose W is still to come

    def backward(stage: int, split: bool) -> None:
        i = ops.add(BACKWARD, stage)
        if split:
            deferred.append((stage, i))

    def weight() -> None:
        if deferred:
            stage, i = deferred.pop(0)
            ops.actions.append(Action(WEIGHT, i, stage))

    def pair(forward_stage: int, backward_stage: int) -> None:
        pairs.append(len(ops.actions))
        ops.add(FORWARD, forward_stage)
        backward(backward_stage, split=False)

    for _ in range(2 * (p - r - 1)):
        ops.add(FORWARD, first)
    for _ in range(r + 1):
        ops.add(FORWARD, first)
        ops.add(FORWARD, second)
    for _ in range(p - r - 1):
        backward(second, split=True)
        weight()
        ops.add(FORWARD, second)
    for _ in range(m - 2 * p + r + 1):  # the main phase: two overlapped pairs a round
        pair(first, second)
        pair(second, first)
    for _ in range(p - r - 1):
        backward(second, split=False)
        pair(second, first)
    split = False
    half = (r + 1) // 2
    for k in range(r + 1):
        split = split or (k == half and r % 2 == 1)
        backward(second, split)
        split = split or (k == half and r % 2 == 0)
        backward(first, split)
    for _ in range(p - r - 1):
        weight()
        backward(first, split)
    while deferred:
        weight()
    return ops.actions, tuple(pairs)


@register_schedule(
    "interleaved_zb",
    stages_per_rank=None,
    closed_form=ClosedForm("3vm+p-1 (m>=p)", lambda p, m, v: 3 * v * m + p - 1 if m >= p else None),
)
def interleaved_zb(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> PipelineSchedule:
    """Interleaved zero bubble (ZB1P on v chunks; torch's ScheduleInterleavedZeroBubble), loop placement.

    Megatron's interleaved order (:mod:`~pipeflow.schedules.interleaved`, any m) with each
    backward split into B and W: rank r warms up with (v - 1) g + p - r - 1 forwards (g the
    first group's size), then alternates F and B; its first r Ws are held back and every later
    B is followed by the oldest pending W, the held-back ones fill the tail.  With v = 1 this is
    exactly :func:`zb_h1`.  p = 2, v = 2, m = 2 (stages 0, 2 on rank 0; 1, 3 on rank 1):

        rank 0: 0F0 0F1 2F0 2F1 2B0 2W0 2B1 2W1 0B0 0W0 0B1 0W1
        rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 3W0 1B0 3W1 1B1 1W0 1W1

    With unit costs the makespan is 3vm + p - 1 for every m >= p (ZB-H1's idle p - 1 per rank,
    now beside v times the work); peak about p micro-batches of a rank's share, as 1F1B.
    """
    _check(num_ranks, num_microbatches)
    if stages_per_rank < 1:
        raise ScheduleError(
            f"interleaved_zb needs at least 1 stage per rank, got schedule.stages_per_rank={stages_per_rank}"
        )
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    total, first_group = m * v, group_sizes(p, m)[0]
    actions = []
    for r in range(p):
        forwards, backwards = interleaved_order(FORWARD, p, m, v, r), interleaved_order(BACKWARD, p, m, v, r)
        warmup = min((v - 1) * first_group + p - r - 1, total)
        acts, pending = forwards[:warmup], []
        for k, b in enumerate(backwards):
            if warmup + k < total:
                acts.append(forwards[warmup + k])
            acts.append(b)
            pending.append(Action(WEIGHT, b.microbatch, b.stage))
            if k >= r:
                acts.append(pending.pop(0))
        actions.append(acts + pending)
    return PipelineSchedule("interleaved_zb", p, p * v, m, loop_placement(p, v), actions)
