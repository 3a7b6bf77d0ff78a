"""Each tp group's all-reduce measured at start (pipeflow/planning/tp_links.py) and used by the
step prediction, and the ranks that share a machine's cores counted by its boot id
(pipeflow/planning/step_model.py): pure unit tests."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipeflow.planning.partition import partition_layers
from pipeflow.planning.profile import LayerProfile
from pipeflow.planning.step_model import HostShare, StepCosts, describe_costs, predict_step, ranks_sharing_cores
from pipeflow.planning.costs.tensor import (TensorLink, largest_collective_bytes, relink_profile, split_profile,
                                           split_profiles)
from pipeflow.planning.tp_links import TpLinks, fold_groups, link_of
from pipeflow.runtime.parallel.mesh_order import MeshGrid
from pipeflow.schedules import build_schedule

BLOCK = LayerProfile("block", params=1000, param_bytes=4000, forward_s=1e-3, backward_s=2e-3, activation_bytes=800,
                     input_grad_s=1.2e-3, weight_grad_s=0.8e-3, output_bytes=100, tp_split=0.8,
                     tp_forward_bytes=400_000, tp_backward_bytes=200_000, tp_forward_collectives=2,
                     tp_backward_collectives=1, tp_norm_bytes=1000)
SLOW = TensorLink(bandwidth_Bps=500e6, latency_s=1e-4)  # gloo on a CPU host, or a link across hosts


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_split_profile_relinked_equals_the_profile_split_over_the_measured_link(sequence_parallel: bool) -> None:
    assumed = split_profile(BLOCK, 4, TensorLink(), sequence_parallel)
    relinked = relink_profile(assumed, 4, TensorLink(), SLOW, sequence_parallel)
    direct = split_profile(BLOCK, 4, SLOW, sequence_parallel)
    for key in ("forward_s", "backward_s", "input_grad_s", "weight_grad_s"):
        assert getattr(relinked, key) == pytest.approx(getattr(direct, key), rel=1e-12), key
    assert relinked.param_bytes == direct.param_bytes and relink_profile(assumed, 1, TensorLink(), SLOW) == assumed
    assert largest_collective_bytes([BLOCK, replace(BLOCK, tp_forward_bytes=0)]) == 200_000  # 400 KB in 2
    assert largest_collective_bytes([replace(BLOCK, tp_forward_bytes=0, tp_backward_bytes=0)]) == 0.0


def test_each_group_takes_its_slowest_rank_and_each_pipeline_rank_its_slowest_group() -> None:
    grid = MeshGrid(2, 2, 2, ("pp", "dp", "tp"))  # tp groups [0,1] [2,3] of pp 0, [4,5] [6,7] of pp 1
    figures = [(1e-5, 1e-10)] * 8
    figures[3] = (2e-5, 1e-8)  # one rank of pp 0's second group on a slow link
    groups = grid.tp_groups()
    links, per_rank = fold_groups(figures, groups, [grid.coordinates(g[0])[1] for g in groups], 2, 2, 1e6)
    assert [ranks for ranks, _ in links] == [(0, 1), (4, 5), (2, 3), (6, 7)]  # by (dp, pp)
    assert links[2][1] == link_of(2e-5, 1e-8) and per_rank == (link_of(2e-5, 1e-8), link_of(1e-5, 1e-10))
    assert link_of(1e-5, 0.0).all_reduce_s(1e9, 2, 1) == pytest.approx(1e-5)  # no per-byte cost fitted


def test_a_tp_group_far_slower_than_the_others_is_named() -> None:
    fast = TensorLink(10e9, 1e-5)
    links = TpLinks(2, False, (((0, 1), fast), ((2, 3), fast), ((4, 5), SLOW), ((6, 7), fast)), (fast, SLOW), 1e6)
    text = links.describe()
    assert text.startswith("tp all-reduce per group, measured in 0.00 s: ranks [0, 1]: 0.010 ms + 10000.0 MB/s")
    assert "slow tp group: ranks [4, 5] all-reduce of 1.00 MB" in text and "slow tp group: ranks [0, 1]" not in text
    assert links.phrase() == "tp all-reduce 0.100 ms + 500.0 MB/s"


def test_the_step_prediction_costs_each_stages_collectives_on_its_measured_tp_link() -> None:
    schedule, ranges = build_schedule("1f1b", 2, 4), partition_layers(4, 2)
    profiles = split_profiles([replace(BLOCK, name=f"block.{i}") for i in range(4)], 2)  # over the assumed link
    costs = StepCosts("ahead", 1e-5, 1e-9, share=HostShare(cores=64))
    assumed = predict_step(schedule, ranges, profiles, costs).makespan
    fast = TensorLink()
    measured = TpLinks(2, False, (((0, 1), fast), ((2, 3), SLOW)), (fast, SLOW))
    with_links = replace(costs, tp_links=measured)
    direct = [split_profile(replace(BLOCK, name=f"block.{i}"), 2, fast if i < 2 else SLOW) for i in range(4)]
    assert predict_step(schedule, ranges, profiles, with_links).makespan == pytest.approx(
        predict_step(schedule, ranges, direct, costs).makespan, rel=1e-9)
    assert predict_step(schedule, ranges, profiles, with_links).makespan > 1.5 * assumed  # stage 1's link is slow
    assert "tp all-reduce 0.100 ms + 500.0 MB/s" in describe_costs(with_links)


def test_ranks_of_emulated_hosts_on_one_machine_share_its_cores() -> None:
    cores = (0, 1)
    emulated = [("boot-a", cores)] * 4  # 2 hosts x 2 ranks in network namespaces of one kernel
    assert ranks_sharing_cores(emulated, 0, fallback=2) == 4
    two_machines = [("boot-a", cores), ("boot-a", cores), ("boot-b", cores), ("boot-b", cores)]
    assert ranks_sharing_cores(two_machines, 2, fallback=2) == 2
    pinned = [("boot-a", (0,)), ("boot-a", (0,)), ("boot-a", (1,)), ("boot-a", (1,))]  # containers on their own cores
    assert ranks_sharing_cores(pinned, 0, fallback=4) == 2
    assert ranks_sharing_cores([("?", cores)] * 4, 1, fallback=2) == 2  # no boot id: the launcher's local ranks
    assert HostShare(cores=2, ranks_per_pipeline_rank=4 / 2).slowdown(2) == 2.0  # 4 ranks, pp 2, on 2 cores
