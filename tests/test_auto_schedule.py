"""schedule=auto: synthesised for given stage costs and a memory limit (pure, no processes).

Memory in micro-batches of a rank's share (pairs held / stages per rank).  With v stages per
rank each stage does 1/v of a rank's share of the work, so placements compare at equal work.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import warm

from pipeflow.errors import ConfigError, ScheduleError
from pipeflow.planning.layout import Layout, Prediction, describe_layout
from pipeflow.planning.partition import partition_layers
from pipeflow.schedules import StageCosts, build_schedule, load_schedule, simulate, synthesize
from pipeflow.schedules.auto import write_schedule

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gpt_default_profile.json"


def split(rank_share: tuple[float, ...], v: int) -> tuple[float, ...]:
    """Stage costs of p * v stages cut from p equal-work shares (each stage 1/v of its share)."""
    return tuple(rank_share[s // v] / v for s in range(len(rank_share) * v))


def best(p: int, m: int, limit: float, shares: tuple[float, ...]) -> tuple[float, float]:
    """(auto's makespan, the best fitting built-in's) over v = 1, 2, with the shares' costs for F, B and W."""
    autos, builtins = [], []
    for v in (1, 2):
        c = split(shares, v)
        result = synthesize(p, m, v, StageCosts(c, c, c), max_activations=limit)
        assert result.chosen.peak <= limit + 1e-9
        autos.append(result.chosen.makespan)
        if result.best_builtin is not None:
            assert result.best_builtin.peak <= limit + 1e-9
            builtins.append(result.best_builtin.makespan)
    return min(autos), min(builtins, default=math.inf)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_never_worse_than_the_best_builtin_that_fits(p: int) -> None:
    cases = [(p, m, limit, (1.0,) * p) for m in (p, 2 * p, 4 * p)
             for limit in sorted({max(1.0, p / 3), p / 2, float(p), 2.0 * p})]
    with warm.context().Pool(2) as pool:  # pure-Python searches: both cores
        found = pool.starmap(best, cases, chunksize=1)
    for (_, m, limit, _), (auto, builtin) in zip(cases, found):
        assert auto <= builtin, (p, m, limit)


def test_every_builtin_that_fits_is_considered() -> None:
    """Simulating each registered schedule directly: auto is at least as fast as every one of
    them whose peak fits (v = 2, unit costs, p = 4, m = 8, limit p)."""
    chosen = synthesize(4, 8, 2, max_activations=4).chosen.makespan
    for name in ("zbv", "interleaved_zb", "interleaved_1f1b", "v_half", "v_min"):
        result = simulate(build_schedule(name, 4, 8, 2))
        if max(result.peak_activations) / 2 <= 4:
            assert chosen <= result.makespan, name


@pytest.mark.parametrize("m", [8, 16])
def test_strictly_faster_on_uneven_stages(m: int) -> None:
    """Stage costs F = B = W = 1, 1, 1, 2 (the last stage twice as slow), p = 4, limit p."""
    auto, builtin = best(4, m, 4.0, (1.0, 1.0, 1.0, 2.0))
    assert auto < builtin, (auto, builtin)


def gpt_costs(num_stages: int) -> StageCosts:
    """The default GPT's recorded per-layer costs summed over a uniform split into stages."""
    layers = json.loads(FIXTURE.read_text())["layers"]
    ranges = partition_layers(len(layers), num_stages)

    def total(key: str) -> tuple[float, ...]:
        return tuple(math.fsum(layers[i][key] for i in r) for r in ranges)

    return StageCosts(total("forward_s"), total("input_grad_s"), total("weight_grad_s"))


@pytest.mark.parametrize("p, m, limit", [(2, 8, 2.0), (2, 8, 4.0), (4, 16, 4.0)])
def test_strictly_faster_on_the_default_gpts_profiled_costs(p: int, m: int, limit: float) -> None:
    """Embedding and head make the first and last stages light: auto beats every built-in."""
    autos, builtins = [], []
    for v in (1, 2):
        result = synthesize(p, m, v, gpt_costs(p * v), max_activations=limit)
        autos.append(result.chosen.makespan)
        builtins.append(result.best_builtin.makespan)
        assert result.chosen.peak <= limit
    assert min(autos) < min(builtins)


def test_transfer_cost_is_simulated() -> None:
    slow = synthesize(4, 8, 1, comm=0.5)
    assert slow.chosen.makespan > synthesize(4, 8, 1).chosen.makespan
    assert slow.chosen.makespan == simulate(slow.chosen.schedule, comm_latency=0.5).makespan


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ScheduleError, match="max_inflight_microbatches=0.5 is below one micro-batch"):
        synthesize(4, 8, 1, max_activations=0.5)
    with pytest.raises(ScheduleError, match="costs for 4 stages, but 2 ranks x 1"):
        synthesize(2, 4, 1, StageCosts.uniform(4))
    with pytest.raises(ScheduleError, match="auto cannot use schedule.placement=v with 1 stages"):
        synthesize(2, 4, 1, placement="v")
    assert synthesize(4, 8, 2, placement="v").chosen.schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)


def test_deterministic_and_written_as_a_custom_file(tmp_path: Path) -> None:
    """Every rank derives the same schedule; the file loads back with schedule=custom."""
    costs = gpt_costs(8)
    first = synthesize(4, 8, 2, costs, max_activations=3)
    assert first.chosen.schedule.table() == synthesize(4, 8, 2, costs, max_activations=3).chosen.schedule.table()
    path = tmp_path / "schedule_auto.txt"
    write_schedule(first.chosen.schedule, str(path), first.report().splitlines())
    loaded = load_schedule(path)
    assert loaded.table() == first.chosen.schedule.table()
    assert loaded.stage_to_rank == first.chosen.schedule.stage_to_rank
    assert path.read_text().startswith("# auto: makespan ")
    assert "best built-in (" in first.report()


def test_the_run_synthesises_from_the_layouts_profiles(tmp_path: Path) -> None:
    """What the builder does: the layout's profiled costs into the synthesis, the report beside
    the partition table, schedule_auto.txt in the run directory."""
    from pipeflow.planning.auto import auto_for_layout
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.run.assembly import write_auto_schedule

    layers = json.loads(FIXTURE.read_text())["layers"]
    profiles = [LayerProfile(row["name"], 10, 40, row["forward_s"], row["backward_s"], 1000,
                             row["input_grad_s"], row["weight_grad_s"], 100) for row in layers]
    provisional = build_schedule("auto", 4, 8, 1)
    ranges = partition_layers(len(layers), 4)
    layout = Layout(ranges, profiles, [4] * 4, Prediction("x", 0.0, 0.0, ()))
    schedule, new_layout, synthesis = auto_for_layout(provisional, layout, 4.0, None)
    assert schedule.name == "auto" and synthesis.chosen.makespan <= synthesis.best_builtin.makespan
    assert synthesis.chosen.schedule.table() == synthesize(4, 8, 1, gpt_costs(4), 0.0, 4.0).chosen.schedule.table()
    assert "schedule=auto from profiled stage costs" in describe_layout(new_layout, _spec(), schedule)
    written = Path(write_auto_schedule(schedule, synthesis, str(tmp_path)))
    assert written.name == "schedule_auto.txt" and load_schedule(written).table() == schedule.table()


def _spec():
    from pipeflow.models import build_gpt

    return build_gpt(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=16)


def test_max_activations_below_one_is_a_config_error() -> None:
    from pipeflow.config.schema import check_config
    from pipeflow.commands.plan.command import compose_config

    cfg = compose_config(["pipeline.max_activations=0.5"])
    with pytest.raises(ConfigError, match="schedule.max_inflight_microbatches=0.5 must be at least 1"):
        check_config(cfg, 4)


def test_auto_with_offload_fits_a_faster_schedule_under_the_same_limit():
    """With pipeline.offload=auto a candidate counts only what its plan leaves on the device: under
    a 2-micro-batch limit a schedule holding more (hidden copies over a fast link) wins."""
    from pipeflow.schedules.offload import HostLink, OffloadCosts, group_bytes_of

    costs = StageCosts.uniform(4, 1.0, 1.0, 1.0)
    plain = synthesize(4, 8, 1, costs, 0.0, 2.0)
    copies = OffloadCosts(group_bytes_of([1.0] * 4), HostLink(4.0, 4.0))
    offloaded = synthesize(4, 8, 1, costs, 0.0, 2.0, offload=("auto", copies, [0.9] * 4))
    assert offloaded.chosen.makespan < plain.chosen.makespan
    assert offloaded.chosen.peak <= 2.0 and "offload=auto" in offloaded.chosen.label
    # a link that hides nothing: the same choice as without offloading
    crawl = OffloadCosts(group_bytes_of([1.0] * 4), HostLink(1e-3, 1e-3))
    assert synthesize(4, 8, 1, costs, 0.0, 2.0, offload=("auto", crawl, [0.9] * 4)).chosen.makespan == \
        plain.chosen.makespan
