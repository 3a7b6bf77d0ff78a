"""The planner searches the mesh order (pipeflow/planning/order_search.py): on hosts whose links
differ the order whose bytes take the fast links wins and its override is printed; on one host
nothing changes."""
from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from pipeflow.planning.hardware import load_hardware
from pipeflow.planning.mesh_choice import HostLinks
from pipeflow.planning.order_search import HostPlacement, order_note, order_steps
from pipeflow.planning.order_search import pick as pick_order
from pipeflow.planning.partition import partition_layers
from pipeflow.planning.profile import LayerProfile, action_costs
from pipeflow.planning.search import SearchSpace, search
from pipeflow.config.schema import check_config
from pipeflow.commands.plan.command import compose_config
from pipeflow.schedules import RuntimeCosts, build_schedule, simulate

MS = 1e-3
HOSTS = HostPlacement(2, HostLinks(intra=(1e-5, 1e-10), inter=(1e-4, 1e-8)))  # 10 GB/s within, 100 MB/s across
SPACE = SearchSpace(("1f1b",), (4,), (1,), dp=2)


def _costs(param_bytes: int, output_bytes: int):
    def at(b: int) -> list[LayerProfile]:
        return [LayerProfile(f"block.{i}", param_bytes // 4, param_bytes, MS, 2 * MS, output_bytes, MS, MS,
                             output_bytes) for i in range(4)]
    return at


def _pick(param_bytes: int, output_bytes: int, hosts: HostPlacement | None = HOSTS):
    return search(_costs(param_bytes, output_bytes), 2, 8, replace(SPACE, hosts=hosts), comm_latency_s=0.1 * MS).candidates[0]


def test_gradients_that_dominate_take_pp_outermost_and_print_its_override() -> None:
    pick = _pick(param_bytes=16_000_000, output_bytes=1_000)  # 16 MB of gradients per layer, 1 KB boundaries
    assert pick.order == ("pp", "dp", "tp") and "'parallel.order=[pp,dp,tp]'" in pick.overrides()
    default = search(_costs(16_000_000, 1_000), 2, 8, replace(SPACE, hosts=HostPlacement(4, HOSTS.links)),
                     comm_latency_s=0.1 * MS).candidates[0]  # all 4 ranks on one host: no dp all-reduce across
    assert pick.step_s > default.step_s  # on two hosts its boundaries cross the slow link
    words = shlex.split(pick.overrides())
    cfg = compose_config(["model.n_layer=4", "data.batch_size=16", "parallel.dp=2", "parallel.pp=2", *words])
    assert tuple(cfg.parallel.order) == ("pp", "dp", "tp") and check_config(cfg, world_size=4) == (2, 2)


def test_activations_that_dominate_keep_the_default_order_and_print_none() -> None:
    pick = _pick(param_bytes=1_000, output_bytes=4_000_000)  # 1 KB of gradients per layer, 4 MB boundaries
    assert pick.order == ("dp", "pp", "tp") and "parallel.order" not in pick.overrides()


def test_on_one_host_every_order_is_alike_and_the_ranking_unchanged() -> None:
    plain = search(_costs(16_000_000, 1_000), 2, 8, SPACE, comm_latency_s=0.1 * MS).candidates
    one_host = search(_costs(16_000_000, 1_000), 2, 8, replace(SPACE, hosts=HostPlacement(4, HOSTS.links)),
                      comm_latency_s=0.1 * MS).candidates
    assert [(c.step_s, c.split_points, c.order) for c in one_host] == [(c.step_s, c.split_points, c.order) for c in plain]
    assert all(c.order == ("dp", "pp", "tp") for c in plain)
    assert "one host (this machine), every order alike" in order_note(2, 2, [1], None)
    assert order_note(1, 4, [1], None) == ""  # one dimension above 1: one placement
    assert "mesh orders searched on hosts of 2 ranks" in order_note(2, 2, [1], HOSTS)


def test_tp_across_hosts_pays_its_collectives_on_the_slow_link() -> None:
    def costs(b: int) -> list[LayerProfile]:
        return [LayerProfile(f"block.{i}", 250, 1_000, MS, 2 * MS, 1_000, MS, MS, 1_000, tp_split=0.8,
                             tp_forward_bytes=2_000_000, tp_backward_bytes=2_000_000, tp_forward_collectives=2,
                             tp_backward_collectives=2) for i in range(4)]

    space = SearchSpace(("1f1b",), (4,), (1,), dp=1, hosts=HOSTS, tp=2)
    pick = search(costs, 2, 8, space, comm_latency_s=0.1 * MS).candidates[0]
    assert pick.order == ("dp", "pp", "tp")  # tp innermost: its groups inside the hosts, the boundary across
    schedule, ranges = build_schedule("1f1b", 2, 4), partition_layers(4, 2)
    steps = order_steps(schedule, ranges, costs(2), 1, 2, HOSTS, [1_000.0, 1_000.0],
                        lambda transfer: simulate(schedule, costs=action_costs(ranges, costs(2), schedule),
                                                  runtime=RuntimeCosts(transfer)))
    by_order = {s.order: s for s in steps}
    assert by_order[("dp", "pp", "tp")].tp_s == 0.0 and by_order[("dp", "tp", "pp")].tp_s > 0.01  # 4 x 2 MB at 100 MB/s
    assert pick_order(steps).order == ("dp", "pp", "tp")


def test_a_cluster_descriptions_links_place_the_ranks() -> None:
    cluster = load_hardware("h100_sxm")
    hosts = HostPlacement.of_cluster(cluster)
    assert hosts.ranks_per_host == cluster.gpus_per_host and hosts.host_index(2 * cluster.gpus_per_host)[-1] == 1
    assert hosts.links.intra == pytest.approx((cluster.intra.latency_us * 1e-6, 1 / (cluster.intra.bandwidth_gbps * 1e9)))
    assert hosts.links.inter[1] > hosts.links.intra[1]  # fewer bytes per second across hosts
