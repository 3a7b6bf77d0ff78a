"""What the faster runtime relies on: the eager-send simulation and freed output storage.

p = ranks, v = stages per rank, m = micro-batches (as in the schedules package).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeflow.errors import DeadlockError
from pipeflow.schedules import GENERATORS, Action, build_schedule, one_f_one_b, simulate
from pipeflow.schedules.lowering import lower, recvs_needed
from pipeflow.runtime.stage import Stage, run_backward

COSTS = {"F": 1.0, "B": 2.0, "W": 1.0}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_eager_sends_never_slower_and_still_proven(name: str) -> None:
    """Posting recvs early and waiting on sends lazily (gloo) only relaxes rendezvous."""
    for p in (1, 2, 3, 4):
        for m in (2 * p, 3 * p):
            schedule = build_schedule(name, p, m)
            strict = simulate(schedule, costs=COSTS, comm_latency=0.1)
            eager = simulate(schedule, costs=COSTS, comm_latency=0.1, posting="ahead")
            assert eager.makespan <= strict.makespan + 1e-9, (p, m)
            assert len(eager.timeline) == len(strict.timeline)


def test_eager_sends_still_catch_a_deadlock() -> None:
    schedule = one_f_one_b(4, 4)
    schedule.actions[1] = [Action.parse(w) for w in "1F0 1B0 1F1 1F2 1F3 1B1 1B2 1B3".split()]
    with pytest.raises(DeadlockError):
        simulate(schedule, posting="ahead")


def _stage(last: bool) -> Stage:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6).double(), nn.Tanh(), nn.Linear(6, 6).double()]
    return Stage(1 if last else 0, 2, layers, (lambda out, y: (out - y).pow(2).mean()) if last else None)


@pytest.mark.parametrize("weights", [True, False])
def test_freed_outputs_give_the_same_gradients(weights: bool) -> None:
    """deallocate_outputs frees the output storage; backward (full, or B then W) is unchanged."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 6, dtype=torch.float64)
    results = []
    for free in (False, True):
        stage = _stage(last=False)
        xi = x.detach().clone().requires_grad_(True)
        (out,) = stage.forward(0, (xi,))
        if free:
            stage.deallocate_outputs(0)
            assert out.numel() == 0  # storage gone, autograd node kept
        (gx,) = stage.backward(0, (grad,), weights=weights)
        if not weights:
            stage.backward_weight(0)
        results.append([gx] + [p.grad for p in stage.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_tuple_outputs_and_untouchable_ones() -> None:
    """A pass-through output (a leaf, or a view of the input) keeps its storage."""

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.view(-1)

    stage = Stage(0, 2, [Pair()])
    x = torch.randn(3, 2, requires_grad=True)
    doubled, view = stage.forward(0, (x,))
    stage.deallocate_outputs(0)
    assert doubled.numel() == 0 and view.numel() == 6
    (gx,) = stage.backward(0, (torch.ones(3, 2), torch.ones(6)))
    assert torch.equal(gx, torch.full((3, 2), 3.0))


def test_run_backward_returns_input_grads_without_accumulating() -> None:
    w = torch.ones(2, requires_grad=True)
    y = (w * 3).sum()
    (g,) = run_backward([y], None, [w])
    assert torch.equal(g, torch.full((2,), 3.0)) and w.grad is None
    assert run_backward([], None, [w]) == (None,)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_eager_action_waits_only_for_its_own_inputs(name: str) -> None:
    """On gloo a recv is waited on by the action that consumes it: an action with no remote
    input (a W, stage 0's F, a local hand-off) waits for no recv, even when lowering placed a
    recv for a later action before it and that sender is slow; it starts as soon as its rank's
    previous step is done (its action, and the sends that step waits for after it)."""
    for p in (2, 4):
        schedule = build_schedule(name, p, 2 * p)
        slow_stage = schedule.num_stages // 2  # its F is late, so recvs of its output are too

        def costs(action: Action) -> float:
            return 5.0 if action.kind == "F" and action.stage == slow_stage else 1.0

        for posting in ("at_step", "ahead"):
            programs = lower(schedule, posting)
            for program in programs:
                for step in program:
                    needed = set(recvs_needed(step.action, schedule)) if step.action is not None else set()
                    assert set(step.waits) == needed, (p, posting, step)
                    assert all(op.is_send for op in step.after), (p, posting, step)
            result = simulate(schedule, programs, costs=costs, comm_latency=0.1)
            previous_end = [0.0] * p
            sends_after = {(r, step.action): bool(step.after) for r, program in enumerate(programs) for step in program}
            previous_sent = [False] * p
            for rank, action, start, end in sorted(result.timeline, key=lambda entry: (entry[0], entry[2])):
                if not recvs_needed(action, schedule) and not previous_sent[rank]:
                    assert start == pytest.approx(previous_end[rank]), (p, posting, rank, action)
                previous_end[rank], previous_sent[rank] = end, sends_after[rank, action]


def test_ahead_tuner_times_both_settings_then_keeps_the_faster(tmp_path) -> None:
    """comm.recvs_ahead=auto: untimed warm-up, alternating trials, then the faster setting on
    every rank (the slowest rank's medians); ahead stays unless at-step wins by the margin."""
    import torch
    import torch.distributed as dist

    from pipeflow.runtime.posting import AheadTuner

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        for ahead_s, at_step_s, expected in ((1.0, 0.9, False), (1.0, 0.99, True), (0.8, 1.0, True)):
            tuner = AheadTuner(trials=3, warmup=2, margin=0.03)
            settings = []
            while tuner.choice is None:
                ahead = tuner.next_setting()
                settings.append(ahead)
                tuner.record(ahead, ahead_s if ahead else at_step_s, None, cpu)
            assert settings[:2] == [True, True]  # warm-up, untimed
            assert settings[2:] == [True, False] * 3  # alternating trials
            assert tuner.choice is expected and tuner.medians == (ahead_s, at_step_s)
            assert tuner.next_setting() is expected
            tuner.record(not expected, 99.0, None, cpu)  # after the choice nothing changes it
            assert tuner.choice is expected
    finally:
        dist.destroy_process_group()
