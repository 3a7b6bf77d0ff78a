"""``parallel.order``: every rank's mesh coordinates, the groups they make, and the checks."""
from __future__ import annotations

import itertools

import pytest

from pipeflow.errors import ConfigError
from pipeflow.checkpoint.saving import saved_rank
from pipeflow.runtime.parallel.mesh_order import DEFAULT_ORDER, DIMS, MeshGrid, parse_order


def test_the_default_order_is_the_layout_of_old_tp_innermost_then_pp() -> None:
    grid = MeshGrid(2, 3, 2)
    assert grid.order == DEFAULT_ORDER == ("dp", "pp", "tp")
    assert [grid.coordinates(g) for g in range(12)] == [(g // 6, (g // 2) % 3, g % 2) for g in range(12)]


@pytest.mark.parametrize("order", list(itertools.permutations(DIMS)))
def test_every_order_places_each_rank_once_and_its_groups_partition_the_world(order: tuple[str, ...]) -> None:
    grid = MeshGrid(2, 3, 2, order)
    assert sorted(grid.coordinates(g) for g in range(12)) == sorted(itertools.product(range(2), range(3), range(2)))
    assert all(grid.rank(*grid.coordinates(g)) == g for g in range(12))
    for groups in (grid.pipelines(), grid.dp_groups(), grid.tp_groups()):
        assert sorted(g for group in groups for g in group) == list(range(12))
    innermost = {"dp": grid.dp_groups(), "pp": grid.pipelines(), "tp": grid.tp_groups()}[order[-1]]
    assert all(group == list(range(group[0], group[0] + len(group))) for group in innermost)  # consecutive


def test_pp_outermost_puts_each_pipeline_across_the_dp_groups() -> None:
    grid = MeshGrid(2, 2, 1, parse_order("[pp,dp,tp]"))
    assert grid.pipelines() == [[0, 2], [1, 3]] and grid.dp_groups() == [[0, 1], [2, 3]]
    assert grid.describe() == "mesh order [pp,dp,tp]: pipeline ranks [0, 2] [1, 3]"


@pytest.mark.parametrize("value", ["[pp,dp]", ["pp", "pp", "tp"], "dp,pp,ep", []])
def test_an_order_that_is_not_a_permutation_of_dp_pp_tp_is_named(value) -> None:
    with pytest.raises(ConfigError, match=r"parallel.order=.*give each of dp, pp and tp once"):
        parse_order(value)
    assert parse_order("auto") is None and parse_order(["tp", "dp", "pp"]) == ("tp", "dp", "pp")


def test_a_resume_in_another_order_reads_the_random_state_of_the_same_coordinates() -> None:
    now = MeshGrid(2, 2, 1, ("pp", "dp", "tp"))
    meta = {"dp": 2, "pp": 2, "tp": 1, "order": ["dp", "pp", "tp"]}
    assert [saved_rank(meta, g, now) for g in range(4)] == [0, 2, 1, 3]
    assert [saved_rank({"dp": 2, "pp": 2}, g, now) for g in range(4)] == [0, 2, 1, 3]  # saved before orders
    assert [saved_rank({**meta, "dp": 1, "pp": 4}, g, now) for g in range(4)] == [0, 1, 2, 3]  # another layout
