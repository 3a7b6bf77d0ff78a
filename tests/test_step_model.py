"""The whole-step model at start (pipeflow.planning.step_model): shared cores, the runtime's
measured costs in the prediction and the report, the planner's runtime model."""
from __future__ import annotations

import math

import pytest
import torch

from pipeflow.planning.layout import WHOLE_STEP, Layout, describe_layout, predict, with_step_costs
from pipeflow.planning.partition import partition_layers
from pipeflow.planning.profile import LayerProfile, action_costs
from pipeflow.planning.costs.runtime_timing import measure_action_overhead_s, measure_optimizer_s
from pipeflow.planning.step_model import HostShare, StepCosts, predict_step, simulate_shared
from pipeflow.schedules import RuntimeCosts, build_schedule, lower, simulate

MS = 1e-3


def layers(n: int, cpu: float = 1.0) -> list[LayerProfile]:
    return [LayerProfile(f"l{i}", 10, 40, MS, 2 * MS, 100, MS, MS, 4000, cpu_fraction=cpu) for i in range(n)]


def plain_and_shared(share: HostShare, cpu: float = 1.0, name: str = "1f1b") -> tuple[float, float]:
    schedule, profiles = build_schedule(name, 4, 8), layers(4)
    ranges = partition_layers(4, 4)
    cost, programs, runtime = action_costs(ranges, profiles, schedule), lower(schedule, "ahead"), RuntimeCosts(lambda op: 0.0)
    plain = simulate(schedule, programs, cost, runtime=runtime).makespan
    shared = simulate_shared(schedule, programs, cost, runtime, share, lambda action: cpu).makespan
    return plain, shared


def test_ranks_with_cores_of_their_own_are_not_slowed_down() -> None:
    plain, shared = plain_and_shared(HostShare(cores=4))
    assert shared == pytest.approx(plain)
    plain, shared = plain_and_shared(HostShare(cores=1, device="cuda"))  # accelerators compute
    assert shared == pytest.approx(plain)


def test_four_ranks_on_two_cores_run_slower_but_not_twice_as_slow_as_alone() -> None:
    plain, shared = plain_and_shared(HostShare(cores=2))
    assert plain * 1.05 < shared < 2 * plain  # fill and drain are not shared


def test_layers_that_wait_rather_than_compute_share_nothing() -> None:
    plain, shared = plain_and_shared(HostShare(cores=1), cpu=0.0)  # sleep-stages
    assert shared == pytest.approx(plain)


def test_the_slowdown_counts_every_thread_of_the_host() -> None:
    share = HostShare(cores=2, threads_per_rank=2, ranks_per_pipeline_rank=2.0)  # dp = 2
    assert share.slowdown(1) == 2.0 and share.slowdown(2) == 4.0
    assert HostShare(cores=8).slowdown(4) == 1.0


def test_the_whole_step_prediction_adds_the_measured_runtime() -> None:
    schedule, profiles = build_schedule("1f1b", 2, 4), layers(4)
    ranges = partition_layers(4, 2)
    layout = Layout(ranges, profiles, [2, 1], predict(schedule, ranges, profiles))
    costs = StepCosts("ahead", 0.2 * MS, 1e-9, 0.05 * MS, 0.1 * MS, 3 * MS, HostShare(cores=2))
    whole = with_step_costs(layout, schedule, costs)
    sim = predict_step(schedule, ranges, profiles, costs)
    assert whole.prediction.basis == WHOLE_STEP and whole.step_costs == costs
    assert whole.prediction.step_s == pytest.approx(sim.makespan + 3 * MS)
    assert whole.prediction.step_s > layout.prediction.step_s + 3 * MS  # transfers, posting and overheads on top
    runtime = RuntimeCosts(lambda op: 0.2 * MS + 4000e-9, [0.0, 0.0], [0.05 * MS] * 2)
    direct = simulate(schedule, lower(schedule, "ahead"), action_costs(ranges, profiles, schedule, 0.1 * MS),
                      runtime=runtime)
    assert sim.makespan == pytest.approx(direct.makespan)  # 2 ranks on 2 cores: nothing shared
    from pipeflow.models.mlp import build_mlp

    first = describe_layout(whole, build_mlp(num_layers=2), schedule).splitlines()[0]
    assert f"predicted step {1e3 * whole.prediction.step_s:.1f} ms (posting ahead, transfer 0.200 ms" in first
    assert "0.100 ms per action, tail 3.00 ms" in first


def test_without_profiles_the_layout_keeps_its_unit_cost_prediction() -> None:
    schedule = build_schedule("1f1b", 2, 4)
    layout = Layout(partition_layers(4, 2), None, [2, 1], predict(schedule, partition_layers(4, 2), None))
    assert with_step_costs(layout, schedule, StepCosts()) is layout
    assert math.isnan(layout.prediction.step_s)


def test_the_runtime_costs_are_measured_not_assumed() -> None:
    assert measure_action_overhead_s(torch.device("cpu"), repeats=3) >= 0.0
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    assert measure_optimizer_s(params, torch.device("cpu"), repeats=2) > 0.0


def test_the_planner_measures_the_action_overhead_unless_it_is_set() -> None:
    from pipeflow.commands.plan.command import compose_config, run_plan

    words = ["model=gpt", "model.n_layer=2", "data.batch_size=8", "parallel.pp=2", "plan.schedules=[1f1b]",
             "plan.microbatches=[4]", "plan.comm_latency_ms=0"]
    profiled = lambda b: layers(4)  # noqa: E731
    _, measured = run_plan(compose_config(words), costs=profiled)
    assert "ms per action (measured), posting ahead" in measured
    fixed, report = run_plan(compose_config([*words, "plan.action_overhead_ms=5"]), costs=profiled)
    assert "5.000 ms per action (plan.action_overhead_ms)" in report
    slower = fixed.candidates[0].step_s
    zero, _ = run_plan(compose_config([*words, "plan.action_overhead_ms=0"]), costs=profiled)
    assert slower > zero.candidates[0].step_s + 4 * 2 * 5 * MS  # m = 4, F and B each 5 ms more


def test_transfers_take_the_busy_figure_by_the_share_of_the_step_the_host_computes() -> None:
    schedule, profiles = build_schedule("1f1b", 4, 8), layers(4)
    ranges = partition_layers(4, 4)
    cost, programs = action_costs(ranges, profiles, schedule), lower(schedule, "ahead")
    idle = RuntimeCosts(lambda op: 0.1 * MS)
    share = HostShare(cores=4)  # no slow-down of the actions: only the transfers differ

    def step(cpu: float, busy_ms: float) -> float:
        return simulate_shared(schedule, programs, cost, idle, share, lambda a: cpu, lambda op: busy_ms * MS).makespan

    assert step(0.0, 5.0) == pytest.approx(simulate(schedule, programs, cost, runtime=idle).makespan)  # nothing computes
    assert step(1.0, 0.1) == pytest.approx(step(0.0, 5.0))  # busy = idle
    assert step(1.0, 5.0) > step(1.0, 1.0) > step(0.0, 5.0)


def test_a_rehearsal_leaves_no_gradient_buffer_or_random_draw_behind() -> None:
    from pipeflow.planning.rehearsal import untouched
    from pipeflow.runtime.stage import Stage

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5)]
    stage = Stage(0, 1, layers, lambda out, target: out.pow(2).mean())
    stats = [b.clone() for b in stage.module.buffers()]
    draws = torch.get_rng_state()
    with untouched({0: stage}):
        stage.forward(0, (torch.randn(8, 4),), torch.zeros(1), 1.0, keep_for_backward=True)
        stage.backward(0, None)
        assert layers[0].weight.grad is not None and not torch.equal(layers[1].running_mean, stats[0])
    assert all(p.grad is None for p in stage.parameters())
    assert all(torch.equal(b, s) for b, s in zip(stage.module.buffers(), stats))
    assert torch.equal(torch.get_rng_state(), draws) and not stage.losses


def test_a_rehearsal_refuses_stages_that_already_hold_gradients() -> None:
    from pipeflow.planning.rehearsal import untouched
    from pipeflow.runtime.stage import Stage

    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="without gradients"):
        with untouched({0: Stage(0, 1, [layer])}):
            pass


def test_the_rehearsal_lasts_about_its_budget_within_its_bounds() -> None:
    from pipeflow.planning.rehearsal import MAX_STEPS, MIN_STEPS, rehearsal_steps

    assert rehearsal_steps(0.3) == 5  # 1.5 s of 0.3 s steps
    assert rehearsal_steps(10.0) == MIN_STEPS and rehearsal_steps(0.001) == MAX_STEPS
    assert rehearsal_steps(float("nan")) == MAX_STEPS


def test_metrics_rehearse_steps_is_checked_and_read_as_documented() -> None:
    from pipeflow.errors import ConfigError
    from pipeflow.run.assembly import rehearsal_steps_for
    from pipeflow.config.schema import check_config
    from pipeflow.commands.plan.command import compose_config

    with pytest.raises(ConfigError, match=r"metrics.rehearse_steps=-1 must be >= 0"):
        check_config(compose_config(["metrics.rehearse_steps=-1"]), world_size=4)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert rehearsal_steps_for(compose_config([]), cpu) is None  # the default job (300 steps): automatic
    assert rehearsal_steps_for(compose_config(["train.max_steps=10"]), cpu) == 0  # short runs: none
    assert rehearsal_steps_for(compose_config(["train.max_steps=10", "metrics.rehearse_steps=3"]), cpu) == 3
    assert rehearsal_steps_for(compose_config(["metrics.rehearse_steps=3"]), gpu) == 0
    # shard=full rehearses too: its gathers and reduce-scatters run at the program's shard points
    assert rehearsal_steps_for(compose_config(["metrics.rehearse_steps=3", "parallel.shard=full"]), cpu) == 3


def test_an_fsdp_gather_costs_dp_halves_of_the_shards_all_reduce() -> None:
    """``parallel.shard=full``: the dp all-reduce timed at start ran on a rank's shards (its
    DTensors' local parts), n bytes, moving 2 (dp - 1) / dp n on a ring; a stage's gather of the
    whole (dp n bytes) moves (dp - 1) n.  Costed as half the all-reduce, the start-of-run
    prediction of a dp 2 x pp 2 run was 41% short of the measured step."""
    from pipeflow.planning.step_model import with_fsdp_shards

    for dp in (2, 4, 8):
        n, reduce_s = 1e6, 0.01
        per_byte = reduce_s / (2 * (dp - 1) / dp * n)
        gather_s = (dp - 1) * n * per_byte
        costs = with_fsdp_shards(StepCosts(tail_s=0.05, dp_reduce_s=reduce_s), dp, stages_here=2)
        assert costs.shard_s == pytest.approx(gather_s / 2)  # one gather per stage, two stages here
        assert costs.tail_s == pytest.approx(0.04)  # the all-reduce left the tail


def test_the_tail_times_adamw_on_dtensors_as_the_sharded_run_steps_them(one_rank_group) -> None:
    """A DTensor parameter (``parallel.shard=full``, ``parallel.tp``) is stepped by AdamW through
    DTensor's dispatch (about twice its local shard's time on a CPU): the start's scratch copy
    stays a DTensor of the same mesh and placements, over a copy of the local shard; the dp
    all-reduce is timed on the shard's bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from pipeflow.planning.costs.runtime_timing import _scratch_copy, measure_tail_parts

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]))
    copy = _scratch_copy(param)
    assert isinstance(copy, DTensor) and copy.placements == param.placements and copy.device_mesh is param.device_mesh
    assert torch.equal(copy.to_local(), param.to_local()) and copy.to_local().data_ptr() != param.to_local().data_ptr()
    reduce_s, tail_s = measure_tail_parts([param], torch.device("cpu"), repeats=2)
    assert reduce_s == 0.0 and tail_s > 0 and param.grad is None  # the run's parameter untouched
    assert torch.equal(param.to_local(), torch.arange(12.0).reshape(4, 3))
