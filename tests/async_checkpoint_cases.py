"""Checkpoints written in the background (issue 60: ``train.checkpoint_mode=async|async_process``)
on 2 gloo ranks, run inside tests/test_faults.py's world (see mp_harness): the same files as a
synchronous save of the same state while training changes the live tensors at once, a full disk
during the background write (named on every rank at the same step boundary, the partial folder
removed, ``latest`` untouched), the Trainer's saves, a preemption with a save in flight, and a
resume under another layout from a background checkpoint.

Not collected on its own: the ``test_*`` functions below are imported by test_faults.py.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

from checkpoint_cases import _disk_full, _model
from fault_cases import _error, _on_rank0, _shared_dir

FULL = os.strerror(28)


def _digests(folder: str) -> dict[str, str]:
    """The digests a checkpoint's meta.json records, but DCP's ``.metadata`` (it names the
    temporary folder it was written in)."""
    with open(os.path.join(folder, "meta.json")) as f:
        files = json.load(f)["files"]
    return {rel: digest for rel, digest in files.items() if not rel.endswith(".metadata")}


def _train_more(layers: dict, opt: torch.optim.Optimizer) -> None:
    """What the next step does to the live tensors while a save is in flight."""
    for layer in layers.values():
        layer(torch.ones(2, 4)).sum().backward()
    opt.step()


def saves_in_the_background(mode: str) -> dict[str, Any]:
    """The same state saved synchronously and in the background (`mode`), the live tensors
    changed as soon as the background save returns: the same files; the report, polled at
    boundaries, arrives at the same poll on every rank."""
    from pipeflow.checkpoint import saving as ck
    from pipeflow.checkpoint.background import BackgroundSaver

    layers, opt = _model()
    parent = _shared_dir()
    out: dict[str, Any] = {}
    saver = BackgroundSaver(mode, "stop", torch.device("cpu"))
    try:
        sync = ck.save(os.path.join(parent, "sync"), 1, layers, opt, {"scaler": {}}, job="jobA")
        final, waited = saver.save(os.path.join(parent, "async"), 1, layers, opt, {"scaler": {}}, job="jobA")
        _train_more(layers, opt)  # staged: the write must not see this
        polls, report = 0, None
        while report is None:
            report = saver.poll()
            polls += 1
        out.update(waited=waited, polls=polls, path=report.path, error=report.error and str(report.error),
                   final=final, same=_digests(sync) == _digests(final), files=len(_digests(sync)),
                   latest=os.path.basename(ck.find_latest(os.path.join(parent, "async"))))
        again, _ = saver.save(os.path.join(parent, "async"), 2, layers, opt, {"scaler": {}}, job="jobA")
        out["second"] = saver.wait("the end of the case")
        out["second"] = (out["second"].path, out["second"].error)
        out["left"] = sorted(os.listdir(os.path.join(parent, "async")))
    finally:
        saver.close()
        _on_rank0(lambda: shutil.rmtree(parent, ignore_errors=True))
    return out


def _after_a_failed_save(saver: Any, root: str, layers: dict, opt: torch.optim.Optimizer, out: dict) -> None:
    """What the failed save of step 2 left in `root`, and the folder of step 3's save after it."""
    from pipeflow.checkpoint import saving as ck

    out["left"] = sorted(os.listdir(root))
    out["latest"] = os.path.basename(ck.find_latest(root))
    saver.save(root, 3, layers, opt, {"scaler": {}}, job="jobA")
    out["after"] = os.path.basename(saver.wait("the end of the case").path)


def background_save_on_a_full_disk() -> dict[str, Any]:
    """Step 1 written in the background; step 2's background write meets a full disk on rank 1:
    every rank learns it at the same boundary, by name; the partial folder is removed and latest
    still names step 1; ``warn`` logs it, ``stop`` raises it; the next save works."""
    from pipeflow.checkpoint.background import BackgroundSaver, raise_or_warn

    layers, opt = _model()
    root = _shared_dir()
    saver = BackgroundSaver("async", "stop", torch.device("cpu"))
    out: dict[str, Any] = {"root": root}
    try:
        saver.save(root, 1, layers, opt, {"scaler": {}}, job="jobA")
        saver.wait("the full disk")
        with _disk_full("data", 1):
            saver.save(root, 2, layers, opt, {"scaler": {}}, job="jobA")
            report = None
            while report is None:
                report = saver.poll()
        out["stop"] = _error(lambda: raise_or_warn(report, "stop"))
        out["warn"] = _error(lambda: raise_or_warn(report, "warn"))
        _after_a_failed_save(saver, root, layers, opt, out)
    finally:
        saver.close()
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    return out


def killed_writer_process() -> dict[str, Any]:
    """async_process: rank 1's writer process is killed (-9) after step 1; step 2's save fails on
    rank 1 at once while rank 0's writer waits for rank 1's in DCP's collectives: rank 0 stops its
    own, every rank learns the failure by name at the same boundary, latest still names step 1,
    and step 3's save starts new writer processes."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    from pipeflow.checkpoint.background import BackgroundSaver

    layers, opt = _model()
    root = _shared_dir()
    saver = BackgroundSaver("async_process", "stop", torch.device("cpu"))
    out: dict[str, Any] = {"root": root}
    try:
        saver.save(root, 1, layers, opt, {"scaler": {}}, job="jobA")
        saver.wait("the kill")
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(executor._CHECKPOINT_PROCESS._save_process.pid, 9)
            executor._CHECKPOINT_PROCESS._save_process.join(timeout=10)
        dist.barrier()
        saver.save(root, 2, layers, opt, {"scaler": {}}, job="jobA")
        report = saver.wait("the end of the failed save")
        out["error"] = f"{type(report.error).__name__}: {report.error}"
        _after_a_failed_save(saver, root, layers, opt, out)
    finally:
        saver.close()
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    return out


def background_save_given_up() -> dict[str, Any]:
    """A preemption's bounded wait: step 1's background save is still hashing (slowed on rank 1)
    when the wait's deadline passes: every rank gives it up, step 2 is saved at once, and step 1's
    thread, when it gets there, refuses to commit on every rank and removes its partial folder."""
    import time

    from pipeflow.checkpoint import saving as ck
    from pipeflow.checkpoint import integrity
    from pipeflow.checkpoint.background import BackgroundSaver

    layers, opt = _model()
    root = _shared_dir()
    saver = BackgroundSaver("async", "stop", torch.device("cpu"))
    real = integrity.digest_share

    def slow(folder: str, *args: Any) -> Any:
        if dist.get_rank() == 1 and "step_00000001." in folder:
            time.sleep(1.5)
        return real(folder, *args)

    out: dict[str, Any] = {"root": root}
    integrity.digest_share = slow
    try:
        saver.save(root, 1, layers, opt, {"scaler": {}}, job="jobA")
        given_up = saver.inflight
        out["report"] = saver.wait("leaving", timeout_s=0.2)
        out["saved"] = os.path.basename(ck.save(root, 2, layers, opt, {"scaler": {}}, job="jobA"))
        given_up.done.wait(30)
        out["error"] = f"{type(given_up.error).__name__}: {given_up.error}"
        dist.barrier()
        out["left"] = sorted(os.listdir(root))
        out["latest"] = os.path.basename(ck.find_latest(root))
    finally:
        integrity.digest_share = real
        saver.close()
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    return out


def trainer_saving_in_the_background() -> dict[str, Any]:
    """The Trainer with train.checkpoint_mode=async against one with sync, the same run: the same
    files at every saved step; a SIGTERM at the boundary where a save is in flight finishes it
    and saves that step; a run of another layout (dp 2, pp 1) resumes the background checkpoint."""
    import scale_cases
    from pipeflow.run.builder import build_run

    parent = _shared_dir()
    out: dict[str, Any] = {}
    trainers = []
    try:
        folders = {}
        for mode in ("sync", "async"):
            cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=os.path.join(parent, mode), train__max_steps=4,
                                          train__save_every=2, train__checkpoint_mode=mode, metrics__trace_steps=[3])
            trainer = build_run(cfg, torch.device("cpu"))
            trainers.append(trainer)
            trainer.fit()
            folders[mode] = os.path.join(parent, mode, "checkpoints")
            out[f"trace_{mode}"] = _checkpoint_spans(os.path.join(parent, mode, "trace.json"))
        # each host its own part (one host here): the part written in the background on a gloo host group
        cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=os.path.join(parent, "local"), train__max_steps=2,
                                      train__save_every=2, train__checkpoint_mode="async",
                                      train__checkpoint_storage="local")
        trainer = build_run(cfg, torch.device("cpu"))
        trainers.append(trainer)
        trainer.fit()
        local = os.path.join(parent, "local", "checkpoints")
        out["local"] = sorted(os.listdir(local))
        out["local_same"] = _digests(os.path.join(local, "step_00000002")) == \
            _digests(os.path.join(folders["async"], "step_00000002"))
        out["steps"] = {mode: sorted(os.listdir(folders[mode])) for mode in folders}
        out["same"] = [_digests(os.path.join(folders["sync"], step)) == _digests(os.path.join(folders["async"], step))
                       for step in ("step_00000002", "step_00000004")]
        # preempted: the signal reaches rank 0 during step 3, while step 2's save is in flight
        cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=os.path.join(parent, "preempted"),
                                      train__max_steps=6, train__save_every=2, train__checkpoint_mode="async")
        trainer = build_run(cfg, torch.device("cpu"))
        trainers.append(trainer)
        trainer.resume()
        real_save = trainer.save_checkpoint

        def save_then_signal(step: int, sync: bool = False) -> str:
            path = real_save(step, sync)
            if dist.get_rank() == 0 and not sync:
                trainer._signalled = "SIGTERM"
            return path

        trainer.save_checkpoint = save_then_signal
        out["preempted_at"] = trainer._train(0)
        root = os.path.join(parent, "preempted", "checkpoints")
        out["preempted_steps"] = sorted(os.listdir(root))
        # another layout resumes the background checkpoint of step 4
        again_cfg = scale_cases.make_config(2, "1f1b", 2, train__run_dir=os.path.join(parent, "again"),
                                            parallel__pp=1, train__resume=os.path.join(folders["async"], "step_00000004"))
        again = build_run(again_cfg, torch.device("cpu"))
        trainers.append(again)
        out["resumed"] = again.resume()
        trained, resumed = _by_layer(trainers[1]), _by_layer(again)
        out["compared"] = len(resumed)
        out["equal"] = set(trained) == set(resumed) and all(torch.equal(trained[k], resumed[k]) for k in resumed)
    finally:
        for trainer in trainers:
            trainer.close()
        _on_rank0(lambda: shutil.rmtree(parent, ignore_errors=True))
    return out


def _checkpoint_spans(path: str) -> list[tuple] | None:
    """The checkpoint spans of a run's trace (rank 0 writes it): (pid, thread name, name, step, ts, dur)."""
    if dist.get_rank() != 0:
        return None
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return sorted((e["pid"], threads[e["pid"], e["tid"]], e["name"], e["args"]["step"], e["ts"], e["dur"])
                  for e in events if e.get("cat") == "checkpoint")


def _by_layer(trainer: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, by ``<layer index>.<name>``, from every rank."""
    mine = {f"{idx}.{name}": p.detach().clone() for s, stage in trainer.parts.stages.items()
            for layer, idx in zip(stage.module, trainer.ranges[s]) for name, p in layer.named_parameters()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {key: value for part in every for key, value in part.items()}


WORLD_CASES = [
    ("async-thread", functools.partial(saves_in_the_background, "async")),
    ("async-process", functools.partial(saves_in_the_background, "async_process")),
    ("async-disk-full", background_save_on_a_full_disk),
    ("async-writer-killed", killed_writer_process),
    ("async-given-up", background_save_given_up),
    ("async-trainer", trainer_saving_in_the_background),
]


# ------------------------------------------------------------- assertions (run by test_faults.py)
def _values(results: list) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


def _check_background_save(outs: list) -> None:
    assert len({out["polls"] for out in outs}) == 1, outs  # every rank learns it at the same boundary
    for out in outs:
        assert out["waited"] is None and out["error"] is None and out["path"] == out["final"], out
        assert out["same"] and out["files"] >= 3 and out["latest"] == "step_00000001", out
        assert out["second"] == (out["final"].replace("step_00000001", "step_00000002"), None), out
        assert out["left"] == ["latest", "step_00000001", "step_00000002"], out


def test_async_checkpoints_hold_the_files_a_synchronous_save_writes(world) -> None:
    """Issue 60: the thread writer's checkpoint, bit for bit the synchronous one of the same state,
    though training changed the live tensors as soon as it was staged."""
    _check_background_save(_values(world["async-thread"]))


def test_async_process_checkpoints_hold_the_files_a_synchronous_save_writes(world) -> None:
    """Issue 60: likewise through DCP's writer process (one per rank)."""
    _check_background_save(_values(world["async-process"]))


def test_a_full_disk_during_a_background_write_is_named_on_every_rank_and_latest_stays(world) -> None:
    for out in _values(world["async-disk-full"]):
        root = out["root"]
        assert out["left"] == ["latest", "step_00000001"] and out["latest"] == "step_00000001", out
        assert out["stop"].startswith(f"CheckpointError: checkpoint of step 2 not written ({root}/step_00000002.jobA.tmp): "
                                      f"writing its files failed on rank 1: OSError: [Errno 28] {FULL}"), out["stop"]
        assert f"latest still names {root}/step_00000001" in out["stop"], out["stop"]
        assert out["warn"] == "no error" and out["after"] == "step_00000003", out


def test_a_killed_writer_process_is_named_on_every_rank_and_the_next_save_starts_anew(world) -> None:
    for out in _values(world["async-writer-killed"]):
        root = out["root"]
        assert out["error"].startswith(f"CheckpointError: checkpoint of step 2 not written ({root}/step_00000002.jobA.tmp):"
                                       f" writing its files failed on rank 0: "), out["error"]
        # rank 0's writer was stopped for rank 1's, unless it saw rank 1's writer gone first (gloo)
        assert re.search(r"on rank 0: (its writer process was stopped: another rank's had failed|RuntimeError: .*"
                         r"Connection closed by peer.*); rank 1: BrokenPipeError", out["error"]), out["error"]
        assert f"latest still names {root}/step_00000001" in out["error"], out["error"]
        assert out["left"] == ["latest", "step_00000001"] and out["latest"] == "step_00000001", out
        assert out["after"] == "step_00000003", out


def test_a_background_save_given_up_never_commits_and_latest_names_the_newer_save(world) -> None:
    for out in _values(world["async-given-up"]):
        root = out["root"]
        assert out["report"] is None and out["saved"] == "step_00000002", out
        assert out["error"] == (f"CheckpointError: checkpoint of step 1 not written ({root}/step_00000001.jobA.tmp): "
                                f"deciding to commit it failed on rank 0: checkpoint of step 1 given up before it "
                                f"was committed (a preemption's grace ran out while it was written in the "
                                f"background); rank 1: checkpoint of step 1 given up before it was committed (a "
                                f"preemption's grace ran out while it was written in the background); the partial "
                                f"folder was removed, latest still names {root}/step_00000002"), out["error"]
        assert out["left"] == ["latest", "step_00000002"] and out["latest"] == "step_00000002", out


def test_the_trainer_saves_in_the_background_as_it_saves_in_the_foreground(world) -> None:
    for out in _values(world["async-trainer"]):
        steps = ["latest", "step_00000002", "step_00000004"]
        assert out["steps"] == {"sync": steps, "async": steps} and out["same"] == [True, True], out
        assert out["local"] == ["latest", "step_00000002"] and out["local_same"], out
        # the save of step 2 was in flight at step 3's boundary: finished, then step 3 saved
        assert out["preempted_at"] == 3 and out["preempted_steps"] == ["latest", "step_00000002", "step_00000003"], out
        assert out["resumed"] == 4 and out["compared"] > 0 and out["equal"], out
    # the trace shows each save: training waits for a synchronous save and for a background save's
    # staging (the pipeline's thread), the background write on a thread of its own after it
    sync, background = world["async-trainer"][0].value["trace_sync"], world["async-trainer"][0].value["trace_async"]
    assert {(pid, thread, name, step) for pid, thread, name, step, *_ in sync} == {
        (pid, "pipeline", "checkpoint save (synchronous)", step) for pid in (0, 1) for step in (2, 4)}, sync
    assert {(pid, thread, name, step) for pid, thread, name, step, *_ in background} == {
        (pid, thread, name, step) for pid in (0, 1) for step in (2, 4)
        for thread, name in (("pipeline", "checkpoint staging"), ("checkpoint writer", "checkpoint write (background)"))
    }, background
    for pid in (0, 1):
        staged = [(ts, dur) for p, _, name, _, ts, dur in background if p == pid and name == "checkpoint staging"]
        written = [(ts, dur) for p, _, name, _, ts, dur in background if p == pid and name.startswith("checkpoint write")]
        assert all(w[0] >= s[0] + s[1] - 1 and w[1] > 0 for s, w in zip(staged, written)), (staged, written)
