"""In-run calibration: the run's own recorded steps turned back into the simulator's costs.

Every rank records its training steps (:class:`~pipeflow.runtime.events.EventRecorder`): a
``comm`` event per step that posts or waits (post to the end of its waits), the compute action,
a ``comm`` event for the sends waited after it.  Matched step by step with the program the
rank interpreted (the lowering that ran is the one whose event names match), every moment of a
rank's step is one of (r = a pipeline rank, s = a stage):

    start[r]            rank r's program starts this long after rank 0's step began
    step_overhead[r]    the gap before each program step (interpreting, recording)
    post[r]             posting a step's ops (steps that post and wait for nothing)
    transfer(bytes)     latency + bytes x per_byte: an op completes this long after both sides
                        are posted (from waits that blocked on the peer's post)
    F[s] B[s] W[s] BW[s]  compute of a forward, a split backward's halves, a full backward
    tail                what follows the pipeline: dp reduction, grad-norm all-reduce, optimizer

:func:`calibrate` takes the means over the steps (a step is a sum of its actions: under cores
shared by several ranks each action's time varies with what else runs, and the mean carries
that).  The per-byte transfer term is fitted from the waits that blocked on the peer's post; the
latency so that the simulated step spends as long in batched calls as the run did (on a loaded
machine deliveries arrive late although both sides have posted, and only the total says how
much).  :func:`predict` simulates the program with them
(:class:`~pipeflow.schedules.simulator.RuntimeCosts`): the calibrated prediction.  The simulator
is the model: a log the simulator wrote (:func:`simulated_log`) is recovered exactly.
Times of different ranks are compared on one axis, rank 0's ``time.perf_counter``: each rank
moves its records there (:func:`on_rank0_clock`) by its clock's offset, measured as the trace
does (:func:`pipeflow.runtime.world.clocks.clock_offsets`; 0 on rank 0's host, but on other machines
``perf_counter`` counts from another boot), before they are gathered.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from pipeflow.schedules import PipelineSchedule, Program, RuntimeCosts, lower, simulate
from pipeflow.schedules.ir import ACTIVATION, BACKWARD, FORWARD, KINDS, WEIGHT, Action, CommOp

COSTS_FILE = "costs.json"
LATENCY_RESOLUTION = 1e-6  # relative, of the fitted latency: 20 halvings where 60 took 0.1 s a run
_AFTER = "sends of the step done"
Event = tuple[str, str, float, float]  # kind, name, start, end


class RankStep(NamedTuple):
    """One rank's recorded training step: its start and end and its events (perf_counter s)."""

    start: float
    end: float
    events: Sequence[Event]


def on_rank0_clock(record: RankStep, offset: float) -> RankStep:
    """`record` on rank 0's time axis: every time less `offset`, the recording rank's clock minus
    rank 0's (its entry of :func:`pipeflow.runtime.world.clocks.clock_offsets`)."""
    return RankStep(record.start - offset, record.end - offset,
                    [(kind, name, start - offset, end - offset) for kind, name, start, end in record.events])


@dataclass
class Calibration:
    """The costs a run measured of itself (seconds), and what it measured (see the module docstring).

    Attributes:
        forward, input_grad, weight_grad, backward: per stage, F, split B, W and full backward
            (NaN where the schedule runs none).
        start, step_overhead, post: per pipeline rank.
        latency_s, per_byte_s: an op's transfer time, ``latency_s + bytes * per_byte_s``.
        tail_s: from the last rank's end of program to rank 0's end of step (mean).
        posting: the lowering the run ran (most of the calibrated steps).
        boundary_bytes: per stage, bytes of its outputs (what its sends carry).
        steps: how many steps were calibrated.
        measured_step_s: median step of rank 0 over those steps.
        measured_finish_s: per rank, median end of its program after rank 0's step start.
        meta: what the costs belong to (machine, model, schedule, sizes): see the run's costs.json.
        blocked_latency_s: the latency fitted from the waits that blocked on the peer's post alone
            (the transfer as such; `latency_s` also carries the late deliveries of a busy machine).
        overlap: the run interleaved the schedule's overlapped pairs (``pipeline.overlap_pairs``):
            its programs, and the prediction's, are lowered so.
    """

    forward: list[float]
    input_grad: list[float]
    weight_grad: list[float]
    backward: list[float]
    start: list[float]
    step_overhead: list[float]
    post: list[float]
    latency_s: float
    per_byte_s: float
    tail_s: float
    posting: str
    boundary_bytes: list[float]
    steps: int
    measured_step_s: float
    measured_finish_s: list[float]
    meta: dict[str, Any] = field(default_factory=dict)
    blocked_latency_s: float = math.nan
    overlap: bool = False

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds of one transfer of `num_bytes`."""
        return self.latency_s + num_bytes * self.per_byte_s

    def op_bytes(self, op: CommOp) -> float:
        """Bytes an op carries: the outputs of the stage whose activations (or their grads) it moves."""
        return self.boundary_bytes[op.src_stage if op.payload == ACTIVATION else op.dst_stage]

    def action_cost(self, schedule: PipelineSchedule) -> Callable[[Action], float]:
        """The simulator's cost of each action of `schedule` (a full backward all in its B)."""
        split = schedule.split_backwards()

        def cost(action: Action) -> float:
            s, whole = action.stage, (action.stage, action.microbatch) not in split
            if action.kind == FORWARD:
                return self.forward[s]
            if action.kind == BACKWARD:
                return self.backward[s] if whole else self.input_grad[s]
            return 0.0 if whole else self.weight_grad[s]

        return cost

    def runtime(self) -> RuntimeCosts:
        """The runtime's costs for the simulator."""
        return RuntimeCosts(lambda op: self.transfer_s(self.op_bytes(op)), self.step_overhead, self.post, self.start)

    def to_json(self) -> str:
        """The costs as JSON (NaN written as null)."""
        def clean(value: Any) -> Any:
            if isinstance(value, float) and math.isnan(value):
                return None
            if isinstance(value, list):
                return [clean(v) for v in value]
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            return value

        return json.dumps(clean(asdict(self)), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Read what :meth:`to_json` wrote."""
        data = json.loads(text)
        for key in ("forward", "input_grad", "weight_grad", "backward"):
            data[key] = [math.nan if v is None else v for v in data[key]]
        return cls(**data)


class Prediction(NamedTuple):
    """The calibrated prediction: the whole step and each rank's end of program (seconds)."""

    step_s: float
    finish_s: list[float]


def predict(schedule: PipelineSchedule, cal: Calibration, posting: str | None = None) -> Prediction:
    """Simulate `schedule`'s program (lowered as `posting`, default the calibrated run's) with `cal`'s costs."""
    programs = lower(schedule, posting or cal.posting, overlap=cal.overlap)
    sim = simulate(schedule, programs, cal.action_cost(schedule), runtime=cal.runtime())
    return Prediction(max(sim.finish) + cal.tail_s, list(sim.finish))


def simulated_log(
    schedule: PipelineSchedule, programs: list[Program], cost: Callable[[Action], float], runtime: RuntimeCosts,
    tail_s: float, origin: float = 0.0,
) -> list[RankStep]:
    """The step the simulator predicts, as every rank's recorder would log it (rank 0's step
    starting at `origin`, ending `tail_s` after the last rank's program): a synthetic log."""
    sim = simulate(schedule, programs, cost, runtime=runtime)
    end = origin + max(sim.finish) + tail_s
    return [RankStep(origin if r == 0 else origin + min(e[2] for e in sim.events[r]), end,
                     [(k, n, origin + a, origin + b) for k, n, a, b in sim.events[r]])
            for r in range(schedule.num_ranks)]


def expected_events(program: Program) -> list[tuple[str, str, int]]:
    """(kind, name, program step) of every event a rank running `program` records, in order.

    A step with shard points (``parallel.shard=full``) that posts records its posting, then (after
    the gathers) its wait, under one name.  An overlapped pair (a step, then one marked ``paired``)
    records the first's call and action,
    then the second's waits (its ops are posted inside the pair, unrecorded), its action and its
    ``after`` (:meth:`pipeflow.runtime.pipeline.Pipeline._run_pair`)."""
    out = []
    for k, step in enumerate(program):
        if step.paired:
            continue
        second = program[k + 1] if k + 1 < len(program) and program[k + 1].paired else None
        if (step.unshard or step.reshard) and step.ops:  # posted before the shard points, waited after them
            out.append(("comm", step.ops_text, k))
        if step.ops or step.waits:
            out.append(("comm", step.ops_text or "; ".join(str(op) for op in step.waits), k))
        if step.action is not None:
            out.append((step.action.kind, str(step.action), k))
        if second is not None:
            if second.waits:
                out.append(("comm", "; ".join(str(op) for op in second.waits), k + 1))
            if second.action is not None:
                out.append((second.action.kind, str(second.action), k + 1))
            if second.after:
                out.append(("comm", _AFTER, k + 1))
        elif step.after:
            out.append(("comm", _AFTER, k))
    return out


def program_events(events: Sequence[Event]) -> list[Event]:
    """The events a program's steps record (batched calls and actions), without those of its
    shard points and activation copies (``parallel.shard=full``, ``pipeline.offload``), whose
    time the calibration leaves in the gaps between actions."""
    return [e for e in events if e[0] == "comm" or e[0] in KINDS]


def in_program_order(events: Sequence[Event], program: Program) -> list[Event] | None:
    """A rank's events of one step in the order `program` records them, or None where they are not
    its events.  An overlapped pair's two actions run on two threads and record as each ends, so
    their events may come in either order: each expected event takes the first recorded one of
    its kind and name."""
    pool = list(program_events(events))
    ordered: list[Event | None] = []
    for kind, name, k in expected_events(program):
        at = next((j for j, e in enumerate(pool) if e[0] == kind and e[1] == name), None)
        if at is None and kind == "comm" and name != _AFTER and program[k].paired:
            ordered.append(None)  # a pair's second that waited at the pair's start records no wait of its own
            continue
        if at is None and kind == "comm" and (program[k].unshard or program[k].reshard) and ordered and \
                ordered[-1] is not None and ordered[-1][1] == name:
            ordered.append(None)  # its posting and its wait logged as one (the simulator's log)
            continue
        if at is None:
            return None
        ordered.append(pool.pop(at))
    return None if pool else ordered  # type: ignore[return-value]


def which_posting(step: Sequence[RankStep], programs: dict[str, list[Program]]) -> str | None:
    """The lowering whose programs every rank's events of this step follow, or None."""
    for option, progs in programs.items():
        if all(in_program_order(rank.events, progs[r]) is not None for r, rank in enumerate(step)):
            return option
    return None


class _Walk(NamedTuple):
    """One rank's step matched with its program: per program step its events."""

    comm: list[Event | None]
    action: list[Event | None]
    after: list[Event | None]


def _walk(program: Program, events: Sequence[Event]) -> _Walk:
    """`events` (in program order: :func:`in_program_order`) assigned to the program's steps."""
    walk = _Walk([None] * len(program), [None] * len(program), [None] * len(program))
    for (kind, name, k), event in zip(expected_events(program), events):
        if event is not None:
            slot = walk.action if kind != "comm" else walk.after if name == _AFTER else walk.comm
            slot[k] = event
    return walk


def _first_start(walk: _Walk, k: int) -> float:
    return next(e[2] for e in (walk.comm[k], walk.action[k], walk.after[k]) if e is not None)


def _last_end(walk: _Walk, k: int) -> float:
    return next(e[3] for e in (walk.after[k], walk.action[k], walk.comm[k]) if e is not None)


def _median(values: Sequence[float], default: float = math.nan) -> float:
    return statistics.median(values) if values else default


def calibrate(
    schedule: PipelineSchedule, steps: Sequence[Sequence[RankStep]], boundary_bytes: Sequence[float],
    postings: Sequence[str] = ("ahead", "at_step", "group", "rendezvous"), meta: dict[str, Any] | None = None,
    overlap: bool = False, shard: bool = False,
) -> Calibration:
    """The runtime's costs from recorded steps (see the module docstring).

    Args:
        schedule: the schedule the run ran.
        steps: ``steps[n][r]``, pipeline rank r's record of step n, on rank 0's time axis
            (:func:`on_rank0_clock`).
        boundary_bytes: per stage, bytes of its outputs.
        postings: the lowerings the run may have interpreted; a step that matches none is left out.
        meta: what the costs belong to, kept in the result.
        overlap: the run interleaved the schedule's overlapped pairs (``pipeline.overlap_pairs``).
        shard: the run gathered and freed sharded parameters at shard points (``parallel.shard=full``):
            their time is left in the gaps before the steps that hold them.

    Raises:
        ValueError: no step matches any lowering's programs.
    """
    programs = {option: lower(schedule, option, shard=shard, overlap=overlap) for option in postings}
    matched = [(which_posting(step, programs), step) for step in steps]
    matched = [(option, step) for option, step in matched if option is not None]
    if not matched:
        raise ValueError(f"none of {len(steps)} recorded steps follows the programs of schedule "
                         f"{schedule.name!r} under {list(postings)}")
    p, S = schedule.num_ranks, schedule.num_stages
    sums, walks = _Sums(p), []
    for option, step in matched:
        walked = [_walk(programs[option][r], in_program_order(step[r].events, programs[option][r])) for r in range(p)]
        walks.append((programs[option], walked))
        sums.add(programs[option], walked, step, schedule.split_backwards())
    compute, gaps, posts, heads = sums.compute, sums.gaps, sums.posts, sums.heads
    finishes, tails, step_times, waits = sums.finishes, sums.tails, sums.step_times, sums.waits
    overhead = [mean(g, 0.0) for g in gaps]
    post = [mean(x, 0.0) for x in posts]
    latency, per_byte = _fit_transfer(_transfer_samples(walks, post, boundary_bytes))
    options = [option for option, _ in matched]
    cal = Calibration(
        forward=[mean(compute["F", s]) for s in range(S)],
        input_grad=[mean(compute["B", s]) for s in range(S)],
        weight_grad=[mean(compute["W", s]) for s in range(S)],
        backward=[mean(compute["BW", s]) for s in range(S)],
        start=[mean(h) - o for h, o in zip(heads, overhead)], step_overhead=overhead, post=post,
        latency_s=latency, per_byte_s=per_byte, tail_s=mean(tails), posting=max(set(options), key=options.count),
        boundary_bytes=[float(b) for b in boundary_bytes], steps=len(matched),
        measured_step_s=_median(step_times), measured_finish_s=[_median(f) for f in finishes], meta=dict(meta or {}),
        overlap=overlap,
    )
    cal.blocked_latency_s = latency
    cal.latency_s = _latency_for_waits(schedule, cal, math.fsum(waits) / len(matched))
    return cal


class _Sums:
    """What the recorded steps measured, one list of samples per figure (see :func:`calibrate`)."""

    def __init__(self, p: int) -> None:
        self.compute: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.gaps, self.posts, self.heads, self.finishes = ([[] for _ in range(p)] for _ in range(4))
        self.tails: list[float] = []
        self.step_times: list[float] = []
        self.waits: list[float] = []

    def add(self, progs: list[Program], walked: list[_Walk], step: Sequence[RankStep], split: set) -> None:
        """One step: every rank's gaps, posting, actions and end; the tail, the step, the time in calls."""
        origin = step[0].start
        ends = []
        for r, walk in enumerate(walked):
            shares = _pair_shares(progs[r], walk)
            gap_from: float | None = None  # the end of the rank's last step that recorded anything
            for k, s in enumerate(progs[r]):
                if walk.comm[k] is None and walk.action[k] is None and walk.after[k] is None:
                    continue  # a step of shard points alone: its gathers fall in the next step's gap
                # an overlapped pair's second starts before its first ends: no gap, not a negative one
                (self.heads[r] if gap_from is None else self.gaps[r]).append(
                    max(0.0, _first_start(walk, k) - (origin if gap_from is None else gap_from)))
                gap_from = _last_end(walk, k)
                if s.ops and not s.waits and walk.comm[k] is not None:  # (a pair's second posts unrecorded)
                    self.posts[r].append(walk.comm[k][3] - walk.comm[k][2])
                act = walk.action[k]
                if act is not None:  # the recording gaps inside the step count with the action
                    begin = walk.comm[k][3] if walk.comm[k] is not None else act[2]
                    end = walk.after[k][2] if walk.after[k] is not None else act[3]
                    a = s.action
                    key = ("F" if a.kind == FORWARD else "W" if a.kind == WEIGHT
                           else "B" if (a.stage, a.microbatch) in split else "BW")
                    self.compute[key, a.stage].append((end - begin) * shares.get(k, 1.0))
            ends.append(origin if gap_from is None else gap_from)
            self.finishes[r].append(ends[-1] - origin)
        self.tails.append(step[0].end - max(ends))
        self.waits.append(math.fsum(e[3] - e[2] for rank in step for e in rank.events if e[0] == "comm"))
        self.step_times.append(step[0].end - origin)


def _pair_shares(program: Program, walk: _Walk) -> dict[int, float]:
    """Per action of an overlapped pair, the share of its span that was its own: the two run
    interleaved (one computing while the other waits at an exchange), so each span holds some of
    the other's compute; scaled so that their sum is the pair's wall time, which the simulator
    (F then B, without exchanges to hide) gives back."""
    shares = {}
    for k, step in enumerate(program):
        first, second = walk.action[k - 1] if k else None, walk.action[k]
        if not step.paired or first is None or second is None:
            continue
        wall = max(first[3], second[3]) - min(first[2], second[2])
        total = (first[3] - first[2]) + (second[3] - second[2])
        if total > wall > 0:
            shares[k - 1] = shares[k] = wall / total
    return shares


def mean(values: Sequence[float], default: float = math.nan) -> float:
    """The mean of `values` (`default` when there are none)."""
    return math.fsum(values) / len(values) if values else default


def _comm_time(schedule: PipelineSchedule, cal: Calibration) -> float:
    """Seconds every rank spends in batched calls (posting, waiting) in the simulated step."""
    programs = lower(schedule, cal.posting, overlap=cal.overlap)
    sim = simulate(schedule, programs, cal.action_cost(schedule), runtime=cal.runtime())
    return math.fsum(e[3] - e[2] for events in sim.events for e in events if e[0] == "comm")


def _latency_for_waits(schedule: PipelineSchedule, cal: Calibration, measured: float) -> float:
    """The transfer latency under which the simulated step spends as long in batched calls as the
    run did (`measured`, summed over ranks, a step's mean): the waits transfers cause beyond the
    compute, including deliveries that arrive late although both sides have posted.  The per-byte
    term stays as fitted.  Bisection, to :data:`LATENCY_RESOLUTION` of the latency:
    the time in calls grows with the latency."""
    low, high = 0.0, max(measured, cal.latency_s, 1e-6)
    probe = Calibration(**{**cal.__dict__, "latency_s": low})
    if _comm_time(schedule, probe) >= measured:
        return 0.0
    probe.latency_s = high
    while _comm_time(schedule, probe) < measured:  # every rank waits at least once per transfer
        low, high = high, 2 * high
        probe.latency_s = high
    while high - low > max(LATENCY_RESOLUTION * high, 1e-12):  # each probe simulates the whole step
        probe.latency_s = (low + high) / 2
        if _comm_time(schedule, probe) < measured:
            low = probe.latency_s
        else:
            high = probe.latency_s
    return (low + high) / 2


def _op_key(op: CommOp) -> tuple:
    return (op.payload, op.microbatch, op.src_stage, op.dst_stage, op.is_send)


def _transfer_samples(
    walks: list[tuple[list[Program], list[_Walk]]], post: list[float], boundary_bytes: Sequence[float],
) -> list[tuple[float, float]]:
    """(bytes, seconds) of every wait that blocked on its peer's post: the counterpart was posted
    after the wait began, so the wait ended a transfer after the later post."""
    samples = []
    for progs, walked in walks:
        posted: dict[tuple, float] = {}
        for r, walk in enumerate(walked):
            for k, s in enumerate(progs[r]):
                if walk.comm[k] is not None:  # a pair's second posts inside the pair, unrecorded
                    posted.update((_op_key(op), walk.comm[k][2]) for op in s.ops)
        for r, walk in enumerate(walked):
            for k, s in enumerate(progs[r]):
                for ops, event, begin in ((s.waits, walk.comm[k], post[r] if s.ops else 0.0), (s.after, walk.after[k], 0.0)):
                    if not ops:
                        continue
                    sizes = {boundary_bytes[op.src_stage if op.payload == ACTIVATION else op.dst_stage] for op in ops}
                    both = [(posted.get(_op_key(op)), posted.get(_op_key(op)[:-1] + (not op.is_send,))) for op in ops]
                    if event is None or any(a is None or b is None for a, b in both):
                        continue  # a side posted unrecorded (an overlapped pair): no sample
                    ready = max(max(a, b) for a, b in both)
                    if len(sizes) == 1 and ready >= event[2] + begin:
                        samples.append((float(sizes.pop()), event[3] - ready))
    return samples


def _fit_transfer(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency, per byte) through the median time of each size (least squares over the sizes;
    one size: its median, no per-byte term); (0, 0) without samples."""
    by_size: dict[float, list[float]] = defaultdict(list)
    for size, seconds in samples:
        by_size[size].append(seconds)
    points = [(size, statistics.median(times)) for size, times in sorted(by_size.items())]
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return max(0.0, points[0][1]), 0.0
    mx = math.fsum(x for x, _ in points) / len(points)
    my = math.fsum(y for _, y in points) / len(points)
    slope = math.fsum((x - mx) * (y - my) for x, y in points) / math.fsum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def calibrator(schedule: PipelineSchedule, boundary_bytes: Sequence[float], meta: dict[str, Any],
               overlap: bool = False, shard: bool = False) -> Callable[[Sequence[Sequence[RankStep]]], Calibration]:
    """:func:`calibrate` bound to a run's schedule, boundary sizes, description (for its metrics),
    ``pipeline.overlap_pairs`` and whether it shards its parameters (``parallel.shard=full``)."""
    def run(steps: Sequence[Sequence[RankStep]]) -> Calibration:
        return calibrate(schedule, steps, boundary_bytes, meta=meta, overlap=overlap, shard=shard)

    return run


def stage_boundary_bytes(ranges: Sequence[range], profiles: Sequence[Any] | None) -> list[float]:
    """Per stage, the profiled bytes of its last layer's outputs (0 without profiles: the
    transfer is then fitted as a latency alone)."""
    if profiles is None:
        return [0.0] * len(ranges)
    return [float(profiles[r.stop - 1].output_bytes) for r in ranges]
