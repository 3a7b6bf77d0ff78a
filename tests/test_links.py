"""Each pipeline link costed on its own (pipeflow/planning/links.py): the pairs a program uses,
the rounds that time them, the slow link named, and the simulator costing each op on its link."""
from __future__ import annotations

from pipeflow.planning.links import Link, PipelineLinks, link_pairs, matching_rounds
from pipeflow.planning.step_model import StepCosts, transfer_cost
from pipeflow.schedules import build_schedule
from pipeflow.schedules.ir import CommOp


def test_the_pairs_are_the_neighbouring_stages_ranks_and_the_wrap_of_a_loop_placement() -> None:
    assert link_pairs(build_schedule("1f1b", 4, 8)) == [(0, 1), (1, 2), (2, 3)]
    assert link_pairs(build_schedule("interleaved_1f1b", 4, 8)) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert link_pairs(build_schedule("zbv", 2, 4)) == [(0, 1)]  # V: the turn stays on rank 1


def test_rounds_time_pairs_that_share_no_rank_together() -> None:
    rounds = matching_rounds([(0, 1), (0, 3), (1, 2), (2, 3)])
    assert rounds == [[(0, 1), (2, 3)], [(0, 3), (1, 2)]]
    assert all(len({r for pair in group for r in pair}) == 2 * len(group) for group in rounds)


def _links() -> PipelineLinks:
    fast = dict(latency_s=1e-4, per_byte_s=1e-9)
    return PipelineLinks((Link((0, 1), **fast, global_ranks=(0, 1), hosts=("a", "a")),
                          Link((1, 2), 5e-4, 1e-7, global_ranks=(1, 2), hosts=("a", "b")),
                          Link((2, 3), **fast, global_ranks=(2, 3), hosts=("b", "b"))), (0, 1, 2, 3))


def test_a_link_far_slower_than_its_peers_is_named_with_its_hosts_and_ranks() -> None:
    links = _links()
    assert [(link.ranks, round(ratio)) for link, ratio in links.slow(1e6)] == [((1, 2), 91)]
    text = links.describe(1e6)
    assert "pipeline ranks 1-2 crosses hosts a -> b: 0.500 ms + 10.0 MB/s" in text
    assert "pipeline ranks 0-1 within host a: 0.100 ms + 1000.0 MB/s" in text
    assert "slow link: pipeline ranks 1-2 crosses hosts a -> b" in text and "global ranks 1 and 2" in text
    assert PipelineLinks(links.links[:2], (0, 1, 2)).slow(1e6) == []  # two links: no median to stand out from
    # issue 57: pipeline-rank numbers that are not the global ranks were read as global ones
    other = Link((0, 1), 1e-4, 1e-9, global_ranks=(4, 5), hosts=("node2", "node2"))
    assert other.describe().startswith("pipeline ranks 0-1 (global ranks 4 and 5) within host node2: 0.100 ms")


def test_each_op_is_costed_on_its_own_link_and_the_ring_figures_without_links() -> None:
    costs = StepCosts(latency_s=2e-4, per_byte_s=2e-9, links=_links())
    cost = transfer_cost(costs, lambda op: 1e6)
    crossing, local = CommOp("send", "act", 0, 1, 2, 2), CommOp("send", "act", 0, 2, 3, 3)
    assert abs(cost(crossing) - (5e-4 + 0.1)) < 1e-12 and abs(cost(local) - (1e-4 + 1e-3)) < 1e-12
    ring = transfer_cost(StepCosts(latency_s=2e-4, per_byte_s=2e-9), lambda op: 1e6)
    assert abs(ring(crossing) - ring(local)) < 1e-15 and abs(ring(local) - 2.2e-3) < 1e-12


def test_each_dp_group_is_listed_and_one_far_slower_than_the_others_named() -> None:
    from pipeflow.planning.links import describe_dp_groups

    text = describe_dp_groups([((0, 4), 0.010), ((1, 5), 0.011), ((2, 6), 0.090), ((3, 7), 0.010)])
    assert text.startswith("dp all-reduce per group: ranks [0, 4]: 10.00 ms; ranks [1, 5]: 11.00 ms")
    assert "slow dp group: ranks [2, 6] all-reduce 90.00 ms, 8.6x the median" in text
    assert "slow dp group" not in describe_dp_groups([((0, 2), 0.010), ((1, 3), 0.090)])  # two: no median to stand out


def test_a_link_with_a_burst_passes_spaced_transfers_at_line_rate_and_queues_the_rest() -> None:
    from pipeflow.schedules import Bucket, RuntimeCosts, lower, simulate

    schedule = build_schedule("gpipe", 2, 4)
    cost = lambda a: (1.0 if a.stage == 0 else 0.1) if a.kind == "F" else 0.1  # noqa: E731

    def rank1_forwards(burst: float) -> list[float]:
        runtime = RuntimeCosts(transfer=lambda op: 0.0, bucket=lambda op: Bucket(1000.0, 1.5e-3, 0.0, burst))
        sim = simulate(schedule, lower(schedule, "ahead"), cost, runtime=runtime)
        return [round(start, 9) for r, a, start, _ in sim.timeline if r == 1 and a.kind == "F"]

    # 1000 bytes sent every second, 1.5 s each at the sustained rate: a full bucket passes the first,
    # then each finds only what refilled since (tokens at 1/1.5e-3 bytes per second)
    assert rank1_forwards(1000.0) == [1.0, 2.5, 4.0, 5.5]
    assert rank1_forwards(0.0) == [2.5, 4.0, 5.5, 7.0]  # no burst: each queues behind the one before
    assert rank1_forwards(1e9) == [1.0, 2.0, 3.0, 4.0]


def test_the_probe_finds_a_token_buckets_latency_sustained_rate_and_burst(monkeypatch) -> None:
    from pipeflow.planning import links

    latency, sustained, burst = 2e-4, 8e-8, 256e3
    tokens = [burst]

    def exchange(comm, peer, num_bytes, repeats, warmup=2, what=""):  # a tbf link, every call back to back
        times = []
        for _ in range(warmup + repeats):
            fast = min(float(num_bytes), tokens[0])
            tokens[0] -= fast
            times.append(latency + (num_bytes - fast) * sustained)
        return sorted(times[warmup:])[len(times[warmup:]) // 2]

    monkeypatch.setattr(links, "exchange_s", exchange)
    monkeypatch.setattr(links, "stream_s", exchange)
    monkeypatch.setattr(links.time, "sleep", lambda s: tokens.__setitem__(0, burst))  # a pause refills it
    got = links.probe_pair(None, 1, lambda x: x)
    assert abs(got[0] - latency) < 1e-12 and abs(got[1] - sustained) < 1e-15
    assert abs(got[2] - burst) < 1.0
    burst = 0.0  # no bucket: one rate, no burst
    got = links.probe_pair(None, 1, lambda x: x)
    assert got[2] == 0.0 and abs(got[1] - sustained) < 0.01 * sustained  # the latency: 4 KB at that rate
    sleeps = []
    monkeypatch.setattr(links.time, "sleep", sleeps.append)
    sustained = 1e-9  # a fast link: no pause spent looking for a burst that would save microseconds
    got = links.probe_pair(None, 1, lambda x: x)
    assert got[2] == 0.0 and sleeps == [] and abs(got[1] - sustained) < 0.01 * sustained


def test_the_probe_takes_a_links_rate_as_a_stream_each_way_gets_it(monkeypatch) -> None:
    """On a shaped full-duplex link two directions timed at once get half the rate each (each
    direction's acknowledgements queue behind the other's data: 6.0 MB/s each on 100 Mbit, a
    stream alone 11.9, RESULTS.md); the pipeline's transfers, spaced and queued per direction by
    the simulator, get a stream's: the rate is timed one direction at a time."""
    from pipeflow.planning import links

    one_way = 1 / 11.9e6

    def both_ways(comm, peer, num_bytes, repeats, warmup=2, what=""):
        return 2e-4 + num_bytes * 2 * one_way

    def stream(comm, peer, num_bytes, repeats, warmup=2, what=""):
        return 2e-4 + num_bytes * one_way

    monkeypatch.setattr(links, "exchange_s", both_ways)
    monkeypatch.setattr(links, "stream_s", stream)
    monkeypatch.setattr(links.time, "sleep", lambda s: None)
    latency, per_byte, burst = links.probe_pair(None, 1, lambda x: x)
    assert abs(per_byte - one_way) < 0.02 * one_way and burst == 0.0
