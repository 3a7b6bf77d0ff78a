"""The planner: ranking on synthetic costs (against brute force), memory limit, and the CLI."""
from __future__ import annotations

import csv
import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import warm
from pipeflow.config.schema import check_config
from pipeflow.errors import ScheduleError
from pipeflow.planning.partition import partition_layers
from pipeflow.commands.plan.command import compose_config, interpolate
from pipeflow.planning.search import SearchSpace, rank_memory, search
from pipeflow.planning.profile import LayerProfile
from pipeflow.schedules import GENERATORS, LAYOUTS, build_schedule, simulate
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT
from pipeflow.schedules.offload import HostLink

ROOT = Path(__file__).resolve().parents[1]
MS = 1e-3


def layer(name: str, f: float, b: float, w: float, act: int = 0, param_bytes: int = 0) -> LayerProfile:
    """A synthetic layer: F, B (input grad) and W (weight grad) seconds; full backward B + W."""
    return LayerProfile(name, param_bytes // 4, param_bytes, f, b + w, act, b, w)


def uneven_costs(b: int) -> list[LayerProfile]:
    """Five layers with different, affine-in-b costs (a fixed overhead plus a per-sample part)."""
    base = [(1.0, 1.5, 0.5), (3.0, 2.0, 2.5), (2.0, 2.0, 1.0), (0.5, 0.7, 0.3), (2.5, 1.0, 3.0)]
    return [layer(f"l{i}", MS * (0.3 + f * b), MS * (0.2 + bb * b), MS * (0.1 + w * b), 1000 * b)
            for i, (f, bb, w) in enumerate(base)]


BUILT_IN = tuple(name for name in GENERATORS if name != "auto")  # auto is synthesised per split


def brute_force_best(costs, p: int, batch: int, counts, chunks) -> float:
    """The least simulated step over every built-in schedule, m, v and contiguous split, computed directly."""
    best = math.inf
    for name, m in itertools.product(BUILT_IN, counts):
        needed = LAYOUTS[name][0]
        for v in ([needed] if needed is not None else chunks):
            try:
                schedule = build_schedule(name, p, m, v if needed is None else None)
            except ScheduleError:
                continue
            profiles = costs(batch // m)
            S, L = schedule.num_stages, len(profiles)
            split = any(a.kind == WEIGHT for acts in schedule.actions for a in acts)
            for points in itertools.combinations(range(1, L), S - 1):
                bounds = (0, *points, L)
                stage = [profiles[bounds[s]:bounds[s + 1]] for s in range(S)]

                def cost(action, stage=stage, split=split):
                    layers = stage[action.stage]
                    if action.kind == FORWARD:
                        return sum(x.forward_s for x in layers)
                    if action.kind == BACKWARD:
                        return sum(x.input_grad_s if split else x.backward_s for x in layers)
                    return sum(x.weight_grad_s for x in layers)

                best = min(best, simulate(schedule, costs=cost).makespan)
    return best


def test_planner_top_pick_is_the_brute_force_best() -> None:
    counts, chunks = (1, 2, 4, 8), (1, 2)
    result = search(uneven_costs, 2, 8, SearchSpace(BUILT_IN, counts, chunks, splits="all"))
    top = result.candidates[0]
    best = brute_force_best(uneven_costs, 2, 8, counts, chunks)
    assert top.step_s == pytest.approx(best, rel=1e-12)
    assert [c.step_s for c in result.candidates] == sorted(c.step_s for c in result.candidates)
    assert result.num_skipped > 0  # e.g. zbv/dualpipev with too few micro-batches, 6 stages of 5 layers
    # with schedule=auto in the search (synthesised for each split's costs): strictly faster here
    with_auto = search(uneven_costs, 2, 8, SearchSpace(("auto",), counts, chunks, splits="all")).candidates[0]
    assert with_auto.step_s < best and with_auto.schedule == "auto"
    assert "schedule.max_inflight_microbatches=" in with_auto.overrides()


def test_balanced_search_finds_the_balanced_split_of_1f1b() -> None:
    """With the splits restricted to balanced ones, 1F1B on even layers picks the even split."""
    even = lambda b: [layer(f"l{i}", MS * b, MS * b, MS * b) for i in range(8)]  # noqa: E731
    result = search(even, 4, 8, SearchSpace(("1f1b",), (8,)))
    assert result.candidates[0].split_points == (2, 4, 6)
    assert len({c.split_points for c in result.candidates}) == len(result.candidates) <= 3  # deduplicated


def test_with_equal_f_b_w_zbv_beats_1f1b_by_the_textbook_makespans() -> None:
    """F = B = W = 1 ms per layer, 8 layers, p = 4, m = 8 >= 2p: 1F1B takes (m + p - 1)(F + B + W)
    per 2-layer stage = 66 ms; ZB-V on 1-layer stages 6m + p - 1 = 51 ms, its bubble far smaller."""
    even = lambda b: [layer(f"l{i}", MS, MS, MS) for i in range(8)]  # noqa: E731
    result = search(even, 4, 32, SearchSpace(("1f1b", "zbv"), (8,)))
    by_name = {c.schedule: c for c in reversed(result.candidates)}  # the best of each
    assert result.candidates[0].schedule == "zbv"
    assert by_name["zbv"].step_s == pytest.approx(51 * MS) and by_name["1f1b"].step_s == pytest.approx(66 * MS)
    assert by_name["zbv"].bubble < by_name["1f1b"].bubble / 3
    assert "schedule=zbv pipeline.num_microbatches=8 'pipeline.split_points=[1,2,3,4,5,6,7]'" == by_name["zbv"].overrides()


def test_memory_limit_filters_gpipe_with_many_microbatches() -> None:
    """GPipe holds all m micro-batches, 1F1B at most p: a limit between them drops GPipe."""
    heavy = lambda b: [layer(f"l{i}", MS, MS, MS, act=10**6 * b, param_bytes=4000) for i in range(4)]  # noqa: E731
    space = SearchSpace(("gpipe", "1f1b"), (8,))
    free = search(heavy, 2, 16, space)
    assert {c.schedule for c in free.candidates} == {"gpipe", "1f1b"}
    # per-sample activations 1 MB/layer, b = 2, 2 layers per stage: 4 MB per micro-batch held.
    gpipe_peak = max(c.peak_bytes for c in free.candidates if c.schedule == "gpipe")
    # weights and AdamW's two states; the grads only come with the first backward, which frees one
    # micro-batch's 4 MB (tensor_memory samples after every action)
    assert gpipe_peak == pytest.approx(8 * 4e6 + 2 * 4000 * 3)
    limited = search(heavy, 2, 16, space, memory_limit_bytes=3 * 4e6 + 1e6)
    assert {c.schedule for c in limited.candidates} == {"1f1b"}
    assert {c.schedule for c in limited.over_memory} == {"gpipe"}
    assert all(c.peak_bytes <= 13e6 for c in limited.candidates)


def test_offload_makes_a_memory_limit_reachable_at_no_simulated_cost() -> None:
    """GPipe over a limit without offloading fits with pipeline.offload=auto, whose copies hide in
    the gaps (same simulated step); the pick says pipeline.offload=auto."""
    heavy = lambda b: [layer(f"l{i}", MS, MS, MS, act=10**6 * b, param_bytes=4000) for i in range(4)]  # noqa: E731
    limit = 5 * 4e6
    plain = search(heavy, 2, 16, SearchSpace(("gpipe",), (8,)), memory_limit_bytes=limit)
    assert not plain.candidates
    space = SearchSpace(("gpipe",), (8,), offload=("none", "auto", "all"))
    result = search(heavy, 2, 16, space, memory_limit_bytes=limit)
    assert {c.offload for c in result.candidates} >= {"auto"}
    assert {c.offload for c in result.over_memory} == {"none"}
    by_mode = {c.offload: c for c in result.candidates + result.over_memory}
    assert by_mode["auto"].step_s == pytest.approx(by_mode["none"].step_s)
    assert by_mode["auto"].peak_bytes < by_mode["none"].peak_bytes
    assert "pipeline.offload=auto" in by_mode["auto"].overrides()
    # a link too slow to hide a copy: auto offloads nothing (not listed again beside none), all
    # pays for it in time
    slow = SearchSpace(("gpipe",), (8,), offload=("none", "auto", "all"), host_link=HostLink(1e6, 1e6))
    crawl = {c.offload: c for c in search(heavy, 2, 16, slow).candidates}
    assert set(crawl) == {"none", "all"} and crawl["all"].offloaded_groups == 2 * 8
    assert crawl["all"].step_s > 10 * crawl["none"].step_s


def test_rank_memory_charges_the_activations_each_rank_holds() -> None:
    schedule = build_schedule("1f1b", 4, 8)
    memory = rank_memory(schedule, [100.0] * 4, [10.0] * 4, optimizer_factor=2.0)
    assert memory == [400 + 40, 400 + 30, 400 + 20, 400 + 10]  # rank r holds p - r micro-batches


def test_interpolate_is_linear_between_the_profiled_sizes() -> None:
    low, high = [layer("a", 1.0, 2.0, 3.0, act=100)], [layer("a", 5.0, 10.0, 3.0, act=500)]
    at = interpolate(low, 1, high, 5)
    mid = at(3)[0]
    assert (mid.forward_s, mid.input_grad_s, mid.weight_grad_s, mid.activation_bytes) == (3.0, 6.0, 3.0, 300)
    assert at(5)[0] == high[0] and at(1)[0] == low[0]


def test_plan_cli_prints_overrides_that_compose_into_a_valid_config(tmp_path: Path) -> None:
    cmd = ["-m", "pipeflow.plan", "model=gpt", "model.n_layer=2", "model.n_embd=32",
           "data.batch_size=8", "data.num_tokens=5000", "train.precision=bf16", "parallel.pp=2", "plan.top=4",
           "plan.repeats=1",
           f"plan.csv={tmp_path / 'plan.csv'}"]
    run = warm.run_python(cmd, cwd=ROOT, timeout=300,  # a fork of the warm server (tests/warm.py)
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout + run.stderr
    rows = re.findall(r"^\d+ +\| (\S+) +\| (\d+) +\| (\d) +\| ([\d.]+) +\| ([\d.]+)% +\| ([\d.]+) +\| (.+)$",
                      run.stdout, re.M)
    assert len(rows) == 4, run.stdout
    steps = [float(r[3]) for r in rows]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    for name, m, v, _, _, _, overrides in rows:
        words = [w.strip("'") for w in overrides.split()]
        cfg = compose_config(["model.n_layer=2", "data.batch_size=8", "parallel.pp=2", *words])
        assert cfg.schedule.name == name and cfg.pipeline.num_microbatches == int(m)
        assert check_config(cfg, world_size=2) == (1, 2)
        schedule = build_schedule(name, 2, int(m), cfg.schedule.stages_per_rank)
        assert schedule.num_stages == 2 * int(v)
        partition_layers(4, schedule.num_stages, list(cfg.pipeline.split_points))
    pick = ("run the pick: torchrun --nproc-per-node 2 train.py model=gpt model.n_layer=2 model.n_embd=32 "
            "data.batch_size=8 data.num_tokens=5000 train.precision=bf16 parallel.pp=2 " + rows[0][6])
    assert pick in run.stdout, run.stdout
    assert "profiled on cpu (float32, bf16 autocast)" in run.stdout, run.stdout  # as the run computes
    latency = re.search(r"comm measured \(gloo\): ([\d.]+) ms per step", run.stdout)  # plan.comm_latency_ms=null
    assert latency and 0 < float(latency.group(1)) < 1000, run.stdout
    with open(tmp_path / "plan.csv") as f:
        simulated = list(csv.DictReader(f))
    assert len(simulated) > 4
    assert all(abs(float(r["step_ms"]) - s) <= 0.006 for r, s in zip(simulated, steps))  # table rounds to 0.01


def test_fixed_chunk_schedules_are_tried_whatever_the_chunk_counts() -> None:
    """ZB-V always has 2 chunks per rank: plan.max_chunks=1 must not hide it."""
    even = lambda b: [layer(f"l{i}", MS, MS, MS) for i in range(8)]  # noqa: E731
    result = search(even, 2, 8, SearchSpace(("zbv", "interleaved_1f1b"), (4,), chunks=(1,)))
    assert {(c.schedule, c.stages_per_rank) for c in result.candidates} == {("zbv", 2), ("interleaved_1f1b", 1)}


def test_an_action_overhead_favours_fewer_microbatches() -> None:
    """Costs linear in b make more micro-batches always better; a fixed cost per action turns that."""
    linear = lambda b: [layer(f"l{i}", MS * b, MS * b, MS * b) for i in range(4)]  # noqa: E731
    space = SearchSpace(("1f1b",), (2, 4, 8, 16))
    assert search(linear, 2, 16, space).candidates[0].num_microbatches == 16
    slow = search(linear, 2, 16, space, action_overhead_s=20 * MS)
    assert slow.candidates[0].num_microbatches < 16
    # 1F1B, p = 2, m = 16, 2-layer stages: (m + p - 1) (F + B) with F = 2 ms + 20 ms, B = 4 ms + 20 ms
    by_m = {c.num_microbatches: c for c in reversed(slow.candidates)}
    assert by_m[16].step_s == pytest.approx(17 * 46 * MS)


def test_action_costs_one_model_for_planner_and_run_report() -> None:
    """F, the split halves and a full backward cost what the profiles say, in every caller: the
    planner's step for a split schedule equals the start-of-run report's (the report used to
    split every backward evenly, the planner the profiled halves, so they disagreed)."""
    from pipeflow.planning.layout import predict
    from pipeflow.planning.search import _evaluate
    from pipeflow.planning.profile import action_costs
    from pipeflow.schedules import lower
    from pipeflow.schedules.ir import Action

    profiles = [layer(f"l{i}", 1.0 * MS, 1.0 * MS, 3.0 * MS) for i in range(4)]
    ranges = partition_layers(4, 4)
    split, full = build_schedule("zb_h1", 4, 8), build_schedule("1f1b", 4, 8)
    cost = action_costs(ranges, profiles, split, action_overhead_s=0.5 * MS)
    assert cost(Action(FORWARD, 0, 1)) == pytest.approx(1.5 * MS)
    assert cost(Action(BACKWARD, 0, 1)) == pytest.approx(1.5 * MS)
    assert cost(Action(WEIGHT, 0, 1)) == pytest.approx(3.5 * MS)
    cost = action_costs(ranges, profiles, full, action_overhead_s=0.5 * MS)  # a full B is B + W
    assert cost(Action(BACKWARD, 0, 1)) + cost(Action(WEIGHT, 0, 1)) == pytest.approx(4.5 * MS)
    unsplit = [LayerProfile(p.name, 0, 0, p.forward_s, p.backward_s, 0) for p in profiles]
    cost = action_costs(ranges, unsplit, split)  # halves not profiled: half the backward each
    assert cost(Action(BACKWARD, 0, 1)) == cost(Action(WEIGHT, 0, 1)) == pytest.approx(2.0 * MS)
    mixed = build_schedule("dualpipev", 4, 8)  # split and full backwards in one schedule
    weighted = mixed.split_backwards()
    kinds = {(a.stage, a.microbatch) in weighted for acts in mixed.actions for a in acts if a.kind == BACKWARD}
    assert kinds == {True, False}
    cost = action_costs(partition_layers(8, 8), profiles * 2, mixed, action_overhead_s=0.5 * MS)
    for a in (a for acts in mixed.actions for a in acts if a.kind == BACKWARD):
        w = cost(Action(WEIGHT, a.microbatch, a.stage))
        if (a.stage, a.microbatch) in weighted:  # B and W, each one action
            assert (cost(a), w) == (pytest.approx(1.5 * MS), pytest.approx(3.5 * MS))
        else:  # one full backward, one action's overhead
            assert (cost(a), w) == (pytest.approx(4.5 * MS), 0.0)
    for schedule in (split, full, mixed):
        profiles_s = profiles * (schedule.num_stages // 4)
        ranges = partition_layers(len(profiles_s), schedule.num_stages)
        planned = _evaluate(schedule, lower(schedule), ranges, profiles_s, 2.0, (0.0, 0.0), False, schedule.split_backwards())
        reported = predict(schedule, ranges, profiles_s)  # what the start-of-run report reads
        assert planned.step_s == pytest.approx(reported.step_s)


def test_plan_rehearse_builds_the_shortlist_and_ranks_it_by_the_rehearsed_step(tmp_path: Path) -> None:
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.commands.plan.command import run_plan

    words = ["model=gpt", "model.n_layer=2", "model.n_embd=16", "data.batch_size=8", "data.num_tokens=3000",
             "parallel.pp=2", "plan.schedules=[1f1b,gpipe]", "plan.microbatches=[2,4]", "plan.comm_latency_ms=0",
             "plan.action_overhead_ms=0", "plan.rehearse=2", f"plan.csv={tmp_path / 'plan.csv'}"]
    flat = lambda b: [LayerProfile(f"l{i}", 10, 40, 1e-3, 2e-3, 100, 1e-3, 1e-3, 4000) for i in range(4)]  # noqa: E731
    result, report = run_plan(compose_config(words), costs=flat, overrides=words)
    rehearsed = [c for c in result.candidates if c.rehearsed_s is not None]
    assert len(rehearsed) == 2 and result.candidates[:2] == rehearsed, report
    assert rehearsed[0].rehearsed_s <= rehearsed[1].rehearsed_s and all(c.rehearsed_s > 0 for c in rehearsed)
    assert len({(c.schedule, c.num_microbatches) for c in rehearsed}) == 2  # one per kind
    assert "rehearsed (ms)" in report and "rehearsed in 2 processes here" in report, report
    assert "run the pick: torchrun --nproc-per-node 2 train.py " in report and rehearsed[0].overrides() in report
    with open(tmp_path / "plan.csv") as f:
        assert sum(1 for r in csv.DictReader(f) if r["rehearsed_ms"]) == 2


def test_the_planner_takes_parallel_tp_as_the_degree_it_plans_for() -> None:
    """``python -m pipeflow.plan parallel.pp=2 parallel.tp=2`` stopped with 'the world size is 2'
    (issue 38): the planner has no world; it plans dp x pp x tp processes."""
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.commands.plan.command import run_plan

    words = ["model=gpt", "model.n_layer=2", "model.n_embd=16", "data.batch_size=8", "parallel.pp=2", "parallel.tp=2",
             "plan.schedules=[1f1b]", "plan.microbatches=[4]", "plan.comm_latency_ms=0", "plan.action_overhead_ms=0"]
    flat = lambda b: [LayerProfile(f"l{i}", 10, 40, 1e-3, 2e-3, 100, 1e-3, 1e-3, 4000) for i in range(4)]  # noqa: E731
    result, report = run_plan(compose_config(words), costs=flat, overrides=words)
    assert [c.tp for c in result.candidates] == [2], report
    assert "run the pick: torchrun --nproc-per-node 4 train.py " in report, report


def test_the_shortlist_takes_the_best_split_of_each_kind() -> None:
    from pipeflow.planning.search import Candidate
    from pipeflow.commands.plan.rehearsal import shortlist

    cands = [Candidate("1f1b", 4, 1, (1,), 1.0, 0.1, (1.0,)), Candidate("1f1b", 4, 1, (2,), 1.1, 0.1, (1.0,)),
             Candidate("zb_h1", 4, 1, (1,), 1.2, 0.1, (1.0,)), Candidate("1f1b", 8, 1, (1,), 1.3, 0.1, (1.0,))]
    assert shortlist(cands, 2) == [0, 2] and shortlist(cands, 5) == [0, 2, 3] and shortlist(cands, 0) == []


def test_the_planner_rehearses_each_layout_longer_than_a_run_does() -> None:
    """About 2.5 s a lowering, at most 24 steps (a run: 1.5 s, at most 8): 8 steps put the
    planner's ranking off by up to 15% on the default GPT."""
    from pipeflow.commands.plan.rehearsal import run_words

    def steps(predicted_s: float) -> str:
        return next(w for w in run_words(["parallel.pp=2"], "schedule=1f1b", "/tmp/r", predicted_s)
                    if w.startswith("metrics.rehearse_steps="))

    assert steps(0.1) == "metrics.rehearse_steps=24" and steps(0.165) == "metrics.rehearse_steps=15"
    assert steps(5.0) == "metrics.rehearse_steps=3" and steps(0.0) == "metrics.rehearse_steps=24"


def test_plan_offload_keys_reach_the_search_space() -> None:
    from pipeflow.commands.plan.command import search_space

    cfg = compose_config(["model.n_layer=2", "data.batch_size=8", "parallel.pp=2", "plan.offload=[none,auto]",
                          "plan.host_link_gbps=25"])
    space = search_space(cfg, 8)
    assert space.offload == ("none", "auto") and space.host_link.d2h_bytes_per_s == 25e9
    assert search_space(compose_config(["parallel.pp=2"]), 8).offload == ("none",)  # the default: as before
    with pytest.raises(Exception, match=r"plan.offload_modes=\['sometimes'\]") as info:  # a choice: refused composing
        compose_config(["parallel.pp=2", "plan.offload=[sometimes]"])
    assert "expected one of [none, auto, all]" in str(info.value.__cause__)
