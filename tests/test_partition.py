"""Tests for pipeflow.planning.partition: coverage, remainder placement, split points, every error."""
from __future__ import annotations

import pytest

from pipeflow.errors import PartitionError
from pipeflow.planning.partition import check_coverage, format_partition, partition_layers

NAMES = ["embedding", *(f"block.{k}" for k in range(6)), "head"]  # 8 layers


@pytest.mark.parametrize("num_layers", range(1, 21))
def test_uniform_covers_every_layer_exactly_once(num_layers: int) -> None:
    for num_stages in range(1, num_layers + 1):
        ranges = partition_layers(num_layers, num_stages)
        assert len(ranges) == num_stages
        flat = [i for r in ranges for i in r]
        assert flat == list(range(num_layers))  # contiguous, ordered, nothing dropped or doubled
        sizes = [len(r) for r in ranges]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "num_layers, num_stages, sizes",
    [
        (8, 4, [2, 2, 2, 2]),
        (10, 4, [2, 3, 3, 2]),  # extras go to stages 1, 2: not the first, not the last
        (11, 4, [2, 3, 3, 3]),  # the last stage gets one only when all middle ones have one
        (9, 4, [2, 3, 2, 2]),
        (5, 2, [2, 3]),
        (7, 1, [7]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_uniform_remainder_placement(num_layers: int, num_stages: int, sizes: list[int]) -> None:
    assert [len(r) for r in partition_layers(num_layers, num_stages)] == sizes


def test_split_points_by_index() -> None:
    assert partition_layers(8, 3, [3, 6]) == [range(0, 3), range(3, 6), range(6, 8)]
    assert partition_layers(8, 1, []) == [range(0, 8)]
    assert partition_layers(8, 8, list(range(1, 8))) == [range(i, i + 1) for i in range(8)]


def test_split_points_by_name_and_mixed() -> None:
    expected = [range(0, 3), range(3, 7), range(7, 8)]
    assert partition_layers(8, 3, ["block.2", "head"], names=NAMES) == expected
    assert partition_layers(8, 3, [3, "head"], names=NAMES) == expected


def test_split_points_wrong_count() -> None:
    with pytest.raises(PartitionError) as err:
        partition_layers(8, 4, [3, 6])
    msg = str(err.value)
    assert "[3, 6]" in msg and "gives 3 stages" in msg and "4 stages" in msg
    assert "split points needed: 3" in msg


@pytest.mark.parametrize("points, bad", [([0, 4], "[0]"), ([3, 8], "[8]"), ([-1, 9], "[-1, 9]")])
def test_split_points_out_of_range(points: list[int], bad: str) -> None:
    with pytest.raises(PartitionError) as err:
        partition_layers(8, 3, points)
    msg = str(err.value)
    assert bad in msg and "[1, 7]" in msg and "8 layers" in msg


def test_split_points_unsorted() -> None:
    with pytest.raises(PartitionError) as err:
        partition_layers(8, 3, [5, 2])
    msg = str(err.value)
    assert "[5, 2]" in msg and "not increasing" in msg and "[2, 5]" in msg


def test_split_points_duplicate_means_empty_stage() -> None:
    with pytest.raises(PartitionError) as err:
        partition_layers(8, 4, [2, 4, 4])
    msg = str(err.value)
    assert "[2, 4, 4]" in msg and "stage 2 would be empty" in msg


def test_more_stages_than_layers() -> None:
    with pytest.raises(PartitionError) as err:
        partition_layers(3, 5)
    msg = str(err.value)
    assert "5 stages" in msg and "3 layers" in msg


@pytest.mark.parametrize("num_layers, num_stages", [(0, 1), (4, 0)])
def test_non_positive_counts(num_layers: int, num_stages: int) -> None:
    with pytest.raises(PartitionError):
        partition_layers(num_layers, num_stages)


def test_split_point_name_errors() -> None:
    with pytest.raises(PartitionError, match="'block.9' is not a layer name"):
        partition_layers(8, 2, ["block.9"], names=NAMES)
    with pytest.raises(PartitionError, match="no layer names were given"):
        partition_layers(8, 2, ["head"])
    with pytest.raises(PartitionError, match="2.5"):
        partition_layers(8, 2, [2.5])  # type: ignore[list-item]
    with pytest.raises(PartitionError, match="got 3 layer names for 8 layers"):
        partition_layers(8, 2, names=NAMES[:3])


def test_check_coverage_rejects_gaps_and_overlaps() -> None:
    check_coverage([range(0, 2), range(2, 5)], 5)
    for bad in ([range(0, 2), range(3, 5)], [range(0, 3), range(2, 5)], [range(0, 2), range(2, 4)]):
        with pytest.raises(PartitionError):
            check_coverage(bad, 5)
    with pytest.raises(PartitionError, match="stage 1"):
        check_coverage([range(0, 5), range(5, 5)], 5)


def test_format_partition_table() -> None:
    ranges = partition_layers(8, 3, [1, 7])
    table = format_partition(ranges, NAMES, stage_to_rank=[0, 1, 0])
    lines = table.splitlines()
    assert [cell.strip() for cell in lines[0].split("|")] == ["stage", "rank", "layers", "count"]
    assert len(lines) == 2 + 3
    assert [cell.strip() for cell in lines[2].split("|")] == ["0", "0", "embedding", "1"]
    assert "block.0..block.5" in lines[3] and lines[3].rstrip().endswith("6")
    assert lines[4].split("|")[1].strip() == "0" and "head" in lines[4]
    no_rank = format_partition(ranges, NAMES)
    assert no_rank.splitlines()[2].split("|")[1].strip() == "-"
    assert format_partition(ranges, NAMES, {2: 5}).splitlines()[4].split("|")[1].strip() == "5"
