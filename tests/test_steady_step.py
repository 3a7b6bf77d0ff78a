"""The steady training step (issue 29): no host read of a device value but the one read-back of
the previous step's figures, a step late; a non-finite step skipped on the device and raised a
step late, before the next update; ``train.save_on_signal`` agreeing on a step boundary through
the step's own all-reduce.  One in-process gloo rank (no launch)."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_cases  # noqa: E402
from pipeflow.errors import ConfigError, NonFiniteError  # noqa: E402
from pipeflow.run.builder import build_run  # noqa: E402
from pipeflow.run.signals import PREEMPTED_EXIT_CODE, catch_signals, signal_numbers  # noqa: E402
from pipeflow.run.trainer import Trainer  # noqa: E402


def _trainer(tmp_path: Path, fused: bool = True, **overrides) -> Trainer:
    cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=str(tmp_path), optim__grad_clip=0.05, optim__fused=fused,
                                  metrics__memory_steps=[], comm__post_recvs="ahead", **overrides)
    return build_run(cfg, torch.device("cpu"))


class HostReads(TorchDispatchMode):
    """Counts what makes a host wait for a device value: ``item()``, ``float()``, ``bool()``
    (aten._local_scalar_dense), and copies to the CPU; ``tolist()`` is counted by a patch."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalars += 1
        return func(*args, **(kwargs or {}))


def test_a_steady_step_reads_back_only_the_previous_steps_figures(one_rank_group, tmp_path, monkeypatch) -> None:
    trainer = _trainer(tmp_path)
    assert trainer.defers_readback
    order: list[str] = []
    run, finish = trainer.loop.pipeline.run, trainer.finish
    monkeypatch.setattr(trainer.loop.pipeline, "run", lambda *a, **k: (order.append("run"), run(*a, **k))[1])
    monkeypatch.setattr(trainer, "finish", lambda p: (order.append(f"finish {p.step}"), finish(p))[1])
    previous = None
    for step in range(2):  # the first steps learn shapes and choose the posting
        previous, _ = trainer.advance(step, previous)
    lists = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (lists.append(tuple(t.shape)), real_tolist(t))[1])
    order.clear()
    with HostReads() as reads:
        for step in range(2, 5):
            previous, done = trainer.advance(step, previous)
            assert previous.step == step and [p.step for p, _ in done] == [step - 1]
    assert reads.scalars == 0
    assert len(lists) == 3  # one packet per step: [norm, loss, preempt, stage flags]
    assert order == ["run", "finish 1", "run", "finish 2", "run", "finish 3"]  # read a step late, once queued


def test_deferred_read_back_trains_exactly_as_reading_in_the_step(one_rank_group, tmp_path) -> None:
    deferred, direct = _trainer(tmp_path / "a"), _trainer(tmp_path / "b")
    previous, late = None, []
    for step in range(4):
        previous, done = deferred.advance(step, previous)
        late += [(values.loss, values.norm) for _, values in done]
    late.append(tuple(vars(deferred.finish(previous))[k] for k in ("loss", "norm")))
    now = [direct.train_step(step) for step in range(4)]
    assert late == now  # same process, same kernels: only the moment of the read differs
    assert all(torch.equal(a, b) for a, b in zip(deferred.parts.params, direct.parts.params))


def test_a_non_finite_step_is_skipped_on_the_device_and_raised_a_step_late(one_rank_group, tmp_path) -> None:
    trainer = _trainer(tmp_path)
    trainer.advance(0, late=False)
    armed = [True]
    trainer.parts.params[0].register_hook(lambda g: torch.full_like(g, float("nan")) if armed[0] else g)
    before = [p.detach().clone() for p in trainer.parts.params]
    previous, _ = trainer.advance(1)  # NaN gradients: fused AdamW's found_inf skips the update
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, trainer.parts.params))
    armed[0] = False
    with pytest.raises(NonFiniteError, match=r"training step 1: the parameter gradients of stage 0"):
        trainer.advance(2, previous)  # step 2 is queued, step 1 read back: raised before step 2's update
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, trainer.parts.params))


def test_the_clip_stays_on_the_device_and_equals_torchs(one_rank_group) -> None:
    from pipeflow.run.trainer import clip_on_device

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, 3, dtype=torch.float64)) for n in (5, 2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn_like(p) * 4
        r.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    with HostReads() as reads:
        norm, extra = clip_on_device(params, 0.5, None, torch.ones(2, dtype=torch.float64))
    assert reads.scalars == 0 and isinstance(norm, torch.Tensor) and extra.tolist() == [1.0, 1.0]
    torch.testing.assert_close(norm, expected, rtol=1e-12, atol=0)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=0)


def test_a_signal_saves_at_the_next_step_boundary_and_the_run_resumes(one_rank_group, tmp_path) -> None:
    trainer = _trainer(tmp_path, train__max_steps=8, train__save_every=0)
    restore = catch_signals(signal_numbers("SIGUSR1"), trainer._on_signal)
    try:
        trainer.advance(0)
        signal.raise_signal(signal.SIGUSR1)  # as a scheduler would, between steps
        assert trainer._signalled == "SIGUSR1"
        stopped = trainer._train(1)
    finally:
        restore()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # step 1 carried the flag in its all-reduce, read back a step late in step 2: saved after step 2
    assert stopped == 3
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000003"]
    again = _trainer(tmp_path, train__max_steps=8, train__resume="auto")
    assert again.resume() == 3
    assert all(torch.equal(a, b) for a, b in zip(trainer.parts.params, again.parts.params))
    assert PREEMPTED_EXIT_CODE == 75


def _signal_in_evaluation_call(trainer: Trainer, monkeypatch, call: int) -> None:
    """Raise SIGUSR1 (as a scheduler would) while the trainer's `call`-th evaluation batch runs."""
    evaluate, calls = trainer.loop.pipeline.eval, [0]

    def eval_and_signal(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            signal.raise_signal(signal.SIGUSR1)
        return evaluate(*args, **kwargs)
    monkeypatch.setattr(trainer.loop.pipeline, "eval", eval_and_signal)


def _saved_steps(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) if root.exists() else []


@pytest.mark.parametrize(("call", "stopped", "saved"), [
    (5, 2, ["step_00000002"]),  # the 2nd batch of the evaluation after step 2 (3 batches each)
    (1, 0, []),  # the first evaluation, before any step: nothing to save
    (8, 4, ["step_00000004"]),  # the final evaluation, train.save_every=0: the last step is saved
])
def test_a_signal_during_an_evaluation_saves_at_its_next_batch_and_records_it(
        one_rank_group, tmp_path, monkeypatch, call, stopped, saved) -> None:
    trainer = _trainer(tmp_path, train__max_steps=4, train__save_every=0, train__eval_every=2,
                       train__eval_batches=3, train__save_on_signal=["SIGUSR1"])
    _signal_in_evaluation_call(trainer, monkeypatch, call)
    result = trainer.fit()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert result["preempted_at"] == stopped and _saved_steps(tmp_path) == saved
    record = (tmp_path / "preempted").read_text()
    assert record.startswith(f"preempted at step {stopped}: ")
    assert ("nothing saved" in record) == (not saved)
    if saved:
        again = _trainer(tmp_path, train__max_steps=4, train__resume="auto")
        assert again.resume() == stopped
        assert all(torch.equal(a, b) for a, b in zip(trainer.parts.params, again.parts.params))


def test_a_run_that_trains_again_clears_the_preemption_record(one_rank_group, tmp_path) -> None:
    (tmp_path / "preempted").write_text("preempted at step 3: checkpoint x\n")
    _trainer(tmp_path, train__max_steps=1).fit()
    assert not (tmp_path / "preempted").exists()


def test_save_on_signal_names() -> None:
    assert signal_numbers(["SIGTERM", "usr1"]) == [signal.SIGTERM, signal.SIGUSR1]
    assert signal_numbers(None) == signal_numbers(False) == signal_numbers([]) == []
    with pytest.raises(ConfigError, match="SIGKILL"):
        signal_numbers("SIGKILL")
    with pytest.raises(ConfigError, match="not a signal"):
        signal_numbers("SIGNOPE")


def test_ctrl_c_saves_like_sigterm_counts_torchruns_copy_once_and_a_second_press_quits(
        one_rank_group, tmp_path, monkeypatch) -> None:
    """Issue 57: SIGINT is in train.save_on_signal's default; under torchrun a worker gets a Ctrl-C
    twice (the terminal's and the agent's) within a moment: one request.  A Ctrl-C pressed again
    later (past signals.REPEAT_WITHIN_S) quits at once with KeyboardInterrupt."""
    from pipeflow.run import signals

    trainer = _trainer(tmp_path, train__max_steps=8, train__save_every=0)
    assert signal_numbers(trainer.cfg.train.save_on_signal) == [signal.SIGTERM, signal.SIGINT]
    received: list[str] = []
    before = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN where the suite runs in the background
    monkeypatch.setattr(signals, "REPEAT_WITHIN_S", 0.2)
    restore = catch_signals(signal_numbers(trainer.cfg.train.save_on_signal), received.append)
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # torchrun's copy: no KeyboardInterrupt, one request
        assert received == ["SIGINT"]
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # pressed again: quit without waiting for the save
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) is before
    stopped = catch_signals([signal.SIGINT], trainer._on_signal)
    try:
        trainer.advance(0)
        signal.raise_signal(signal.SIGINT)
        assert trainer._train(1) == 3  # saved at the next step boundary, as on SIGTERM
    finally:
        stopped()
    assert _saved_steps(tmp_path) == ["step_00000003"]


def test_without_fused_adamw_the_step_reads_back_before_its_update(one_rank_group, tmp_path) -> None:
    trainer = _trainer(tmp_path, fused=False)
    assert not trainer.defers_readback
    waiting, done = trainer.advance(0)
    assert waiting is None and [p.step for p, _ in done] == [0] and done[0][1].loss > 0


def test_a_nan_in_the_input_batch_read_back_a_step_late_names_the_batch(one_rank_group, tmp_path) -> None:
    from omegaconf import OmegaConf

    from pipeflow.config.schema import Config, GaussianDataConfig, MLPModelConfig

    cfg = OmegaConf.structured(Config(model=MLPModelConfig(in_features=8, num_classes=4, num_layers=2),
                                      data=GaussianDataConfig(batch_size=8, in_features=8, num_classes=4)))
    cfg.pipeline.update(num_microbatches=2, profile=False)
    cfg.optim.update(fused=True)
    cfg.train.update(run_dir=str(tmp_path), max_steps=4, eval_every=0)
    cfg.metrics.update(memory_steps=[], tensorboard=False)
    trainer = build_run(cfg, torch.device("cpu"))
    source, real = trainer.plan.batches.train, trainer.plan.batches.train.get

    def poisoned(step: int):
        x, y = real(step)
        if step == 1:
            x = x.clone()
            x[5, 0] = float("nan")  # a row of micro-batch 1
        return x, y
    source.get = poisoned
    previous, _ = trainer.advance(0)
    previous, _ = trainer.advance(1, previous)
    with pytest.raises(NonFiniteError, match=r"training step 1: the input batch holds NaN or Inf: micro-batch 1"):
        trainer.advance(2, previous)


def test_a_gone_launcher_waits_for_a_save_on_a_signal(monkeypatch) -> None:
    import time

    from pipeflow.runtime.world import distributed

    parent = [4242]
    exits: list[int] = []
    monkeypatch.setattr(distributed.os, "getppid", lambda: parent[0])
    monkeypatch.setattr(distributed.os, "_exit", exits.append)
    distributed.saving_on_signal(True)
    try:
        thread = distributed.watch_parent(poll_s=0.01)
        parent[0] = 1  # the launcher died (a second signal ended torchrun)
        time.sleep(0.2)
        assert exits == []  # the save goes on
    finally:
        distributed.saving_on_signal(False)
    thread.join(2)
    assert exits == [1]
