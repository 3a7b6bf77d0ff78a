"""Checkpoints that can neither stop a resume nor run code: a damaged ``latest`` is a warning and
the newest verified step is used; a planted ``.metadata`` pickle is refused before anything in it
runs (resume and export); a run directory whose lock vanished or changed hands refuses a save and,
noticed by the lock's watch, stops the training within seconds; a checkpoints folder removed after
this job saved there is not made again; a ``latest`` that is a directory is named; the first failure
of a job whose culprit died without a word is named honestly.  One process: no process group, or
one in-process gloo rank (the 2-rank save failures are in checkpoint_cases.py, run by test_faults.py)."""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pipeflow.errors import CheckpointError, RunDirLostError, UnsafeCheckpointError
from pipeflow.checkpoint import saving as ck
from pipeflow.checkpoint import find as checkpoint_find, integrity, lock
from pipeflow.run import guard
from pipeflow.run.workspace import Workspace
from pipeflow.models import dcp_metadata
from pipeflow.models.dcp_metadata import METADATA_CLASSES, SafeReader, read_dcp_metadata

STEPS = (1, 2, 3)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save(no_dist=True) says so


def _checkpoint(root: Path, step: int) -> Path:
    """A real one-process checkpoint (DCP data and .metadata, meta.json with digests) of a Linear."""
    folder = root / f"step_{step:08d}"
    torch.manual_seed(step)
    layer = torch.nn.Linear(3, 2)
    dcp.save({f"model.layers.0.{k}": v for k, v in layer.state_dict().items()}, checkpoint_id=str(folder), no_dist=True)
    meta = {"step": step, "world_size": 1, "files": integrity.digest_files(str(folder))}
    (folder / ck.META).write_text(json.dumps(meta))
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Checkpoints of steps 1, 2, 3 with ``latest`` naming step 3, whose data file is damaged."""
    folder = tmp_path / "checkpoints"
    for step in STEPS:
        _checkpoint(folder, step)
    (folder / ck.LATEST).write_text("step_00000003")
    data = next((folder / "step_00000003").glob("*.distcp"))
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # a flipped bit: step 3 fails its digest
    data.write_bytes(bytes(damaged))
    return folder


# --------------------------------------------------------------------------------- latest
@pytest.mark.parametrize(("content", "said"), [
    (random.Random(28).randbytes(64), "is damaged (not text"),
    (b"step_00000002\x00", "is damaged (not one folder name"),
    (b"step_0000\x000002", "is damaged (not one folder name"),
    (b"", "is damaged (empty)"),
    (b"step_00000099", "names step_00000099, which is not a complete checkpoint (missing"),
], ids=["random-bytes", "trailing-nul", "inner-nul", "empty", "missing-folder"])
def test_a_damaged_latest_is_a_warning_naming_it_and_resume_takes_the_newest_verified_step(
        root: Path, content: bytes, said: str, caplog: pytest.LogCaptureFixture) -> None:
    (root / ck.LATEST).write_bytes(content)
    checkpoint_find._warned.clear()
    with caplog.at_level(logging.WARNING, logger="pipeflow"):
        assert ck.find_latest(str(root)) == str(root / "step_00000003")  # newest complete, not yet verified
        assert ck.choose("auto", str(root)) == str(root / "step_00000002")  # step 3 fails its digest: skipped
        assert ck.resolve(str(root), str(root)) == str(root / "step_00000003")  # export's choice of a root
    pointer = str(root / ck.LATEST)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith(pointer)]
    assert len(warned) == 1 and said in warned[0], [r.getMessage() for r in caplog.records]
    assert "ignored; the newest complete step_<n> folder beside it is used instead" in warned[0]


def test_a_latest_naming_a_complete_step_is_still_followed_first(root: Path) -> None:
    (root / ck.LATEST).write_text("step_00000001\n")
    assert ck.candidates(str(root))[0] == str(root / "step_00000001")


# ----------------------------------------------------------------------------- .metadata
class _Payload:
    """Unpickling this runs a shell command that creates `marker` (what a planted .metadata does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _plant(folder: Path, marker: Path) -> Path:
    """Replace `folder`'s .metadata with real metadata carrying a payload, and rewrite its digest
    in meta.json (whoever can write a checkpoint can)."""
    metadata = read_dcp_metadata(str(folder / ".metadata"))
    metadata.planner_data = _Payload(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    meta = json.loads((folder / ck.META).read_text())
    meta["files"] = integrity.digest_files(str(folder))
    (folder / ck.META).write_text(json.dumps(meta))
    return folder / ".metadata"


def test_a_planted_metadata_is_refused_before_it_runs_on_resume_and_export(root: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    planted = _plant(root / "step_00000002", marker)
    assert ck.choose("auto", str(root)) == str(root / "step_00000002")  # its digests match: verify cannot tell
    refused = rf"{planted}: refused to load: it names (posix|os)\.system, which DCP checkpoint metadata never holds"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        ck.load(str(root / "step_00000002"), {}, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    with pytest.raises(UnsafeCheckpointError, match=refused):
        ck.export(str(root / "step_00000002"), str(tmp_path / "model.pt"))
    assert ck.main(["export", str(root / "step_00000002"), str(tmp_path / "model.pt")]) == 1  # the CLI
    assert "error: UnsafeCheckpointError: " in capsys.readouterr().err
    with pytest.raises(UnsafeCheckpointError):
        SafeReader(str(root / "step_00000002")).read_metadata()  # what torch's dcp.load is handed
    assert not marker.exists() and not (tmp_path / "model.pt").exists()


def test_a_planted_metadata_in_model_init_from_is_refused_before_it_runs(tmp_path: Path) -> None:
    """model.init_from=<a DCP directory> reads the same .metadata: through the allowlist too."""
    import torch.distributed.checkpoint as dcp

    from pipeflow.models import from_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    folder = tmp_path / "dcp"
    dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
    metadata = read_dcp_metadata(str(folder / ".metadata"))
    metadata.planner_data = _Payload(tmp_path / "ran")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    spec = from_module(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), init_from=str(folder))
    with pytest.raises(UnsafeCheckpointError, match=r"refused to load: it names (posix|os)\.system"):
        spec.build_layers(range(0, 2))
    assert not (tmp_path / "ran").exists()


def test_an_intact_checkpoint_exports_through_the_allowlist(root: Path, tmp_path: Path) -> None:
    assert ck.export(str(root / "step_00000001"), str(tmp_path / "model.pt")) == 2
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    torch.manual_seed(1)
    assert torch.equal(state["0.weight"], torch.nn.Linear(3, 2).weight.detach())


def test_unreadable_metadata_is_a_checkpoint_error_naming_the_file(root: Path) -> None:
    bad = root / "step_00000001" / ".metadata"
    bad.write_bytes(b"\x80\x05not a pickle")
    with pytest.raises(CheckpointError, match=rf"{bad} cannot be read \(UnpicklingError"):
        read_dcp_metadata(str(bad))
    bad.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match=rf"{bad} holds a dict, not torch.distributed.checkpoint Metadata"):
        read_dcp_metadata(str(bad))


def test_the_allowlist_holds_metadata_classes_and_dtypes_only() -> None:
    unpickler = dcp_metadata._MetadataUnpickler(io.BytesIO(), "x/.metadata")
    assert unpickler.find_class("torch", "bfloat16") is torch.bfloat16
    assert unpickler.find_class("torch", "Size") is torch.Size
    for module, name in (("torch", "load"), ("builtins", "eval"), ("builtins", "getattr"), ("os", "system"),
                         ("torch.distributed.checkpoint.metadata", "os"), ("collections", "namedtuple")):
        with pytest.raises(UnsafeCheckpointError, match=rf"x/.metadata: refused to load: it names {module}\.{name},"):
            unpickler.find_class(module, name)
    assert "Metadata" in METADATA_CLASSES["torch.distributed.checkpoint.metadata"]


# ----------------------------------------------------------------------------------- lock
def test_the_lock_is_verified_gone_foreign_or_its_run_dir_removed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = lock.RunLock(str(run_dir))
    token = held.acquire()
    try:
        lock.verify_held(token, "checkpoint of step 4")  # held: nothing to say
        lock.verify_held("another-job", "checkpoint of step 4")  # not a lock this process holds: no check
        path = run_dir / lock.LOCK_FILE
        path.unlink()
        with pytest.raises(RunDirLostError, match=rf"checkpoint of step 4 refused: this job's lock {path} is gone"):
            lock.verify_held(token, "checkpoint of step 4")
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "token": "theirs"}))
        with pytest.raises(RunDirLostError, match=rf"{path} now names another job: pid 1 on host"):
            lock.verify_held(token, "checkpoint of step 4")
        shutil.rmtree(run_dir)
        with pytest.raises(RunDirLostError, match=rf"run directory {run_dir} no longer exists"):
            lock.verify_held(token, "checkpoint of step 4")
    finally:
        held.release()
    lock.verify_held(token, "checkpoint of step 4")  # released: no longer checked


def _wait_for(condition, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


@pytest.mark.parametrize("damage", ["dir-removed", "lock-deleted", "lock-foreign", "own-process-again",
                                    "lock-then-dir"])
def test_the_lock_watch_notices_a_lost_run_dir_within_seconds(tmp_path: Path, monkeypatch, damage: str) -> None:
    """Issue 38 item 7: a removed run directory went unnoticed until the next save (440 steps)."""
    monkeypatch.setattr(lock, "WATCH_S", 0.02)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = lock.RunLock(str(run_dir))
    token = held.acquire()
    again = lock.RunLock(str(run_dir)) if damage == "own-process-again" else None
    try:
        if damage == "dir-removed":
            shutil.rmtree(run_dir)
        elif damage in ("lock-deleted", "lock-then-dir"):
            (run_dir / lock.LOCK_FILE).unlink()
        elif damage == "lock-foreign":
            (run_dir / lock.LOCK_FILE).write_text(json.dumps({"host": "node-7", "pid": 4242, "token": "theirs"}))
        else:
            again.acquire()  # a sweep's next job in this process: the new lock renews, the old one goes quiet
        if damage == "own-process-again":
            assert _wait_for(lambda: not held._thread.is_alive()) and held.lost is None
            return
        assert _wait_for(lambda: held.lost is not None)
        if damage == "lock-then-dir":  # rmtree caught half way by the watch: every rank says the directory went
            shutil.rmtree(run_dir)
        said = str(Workspace(str(run_dir), token, held).lost_error(7))
        path = run_dir / lock.LOCK_FILE
        expected = {"dir-removed": f"run directory {run_dir} no longer exists (removed while this job ran)",
                    "lock-then-dir": f"run directory {run_dir} no longer exists (removed while this job ran)",
                    "lock-deleted": f"this job's lock {path} is gone",
                    "lock-foreign": f"{path} now names another job: pid 4242 on host node-7"}[damage]
        assert said.startswith(f"training stopped at step 7: {expected}"), said
        assert f"train.resume=auto train.run_dir={run_dir}" in said
        # a rank without the lock finds the same on the shared file system
        assert str(Workspace(str(run_dir), token).lost_error(7)) == said
        assert damage not in ("dir-removed", "lock-then-dir") or not run_dir.exists()  # nothing made again
    finally:
        for taken in (held, again):
            if taken is not None:
                taken.release()


def test_a_removed_run_dir_stops_the_training_at_the_next_step(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    """The watch's flag rides in the step's all-reduce: every rank raises at the same step boundary."""
    import scale_cases
    from pipeflow.run.builder import build_run

    monkeypatch.setattr(lock, "WATCH_S", 0.02)
    run_dir = tmp_path / "run"
    cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=str(run_dir), train__max_steps=400,
                                  train__save_every=0, metrics__memory_steps=[])
    trainer = build_run(cfg, torch.device("cpu"))
    try:
        trainer.advance(0, late=False)
        shutil.rmtree(run_dir)
        assert _wait_for(lambda: trainer.loop.workspace.lost)
        with pytest.raises(RunDirLostError, match=rf"training stopped at step [12]: run directory {run_dir} no longer "
                                                 rf"exists \(removed while this job ran\); the job stops"):
            trainer._train(1)
        assert len(trainer.history) <= 3 and not run_dir.exists()  # stopped at once, nothing made again
    finally:
        trainer.close()


def _layer() -> tuple[dict[int, torch.nn.Module], torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = {0: torch.nn.Linear(4, 4)}
    opt = torch.optim.AdamW(layers[0].parameters(), lr=0.1)
    layers[0](torch.ones(2, 4)).sum().backward()
    opt.step()
    return layers, opt


def test_a_checkpoints_folder_removed_after_this_job_saved_there_is_not_made_again(one_rank_group,
                                                                                  tmp_path: Path) -> None:
    """Issue 38 item 6: <run_dir>/checkpoints deleted mid-run was silently made again, the earlier steps lost."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = lock.RunLock(str(run_dir))
    token = held.acquire()
    root = run_dir / "checkpoints"
    layers, opt = _layer()
    try:
        ck.save(str(root), 50, layers, opt, {"scaler": {}}, job=token)  # the first save makes the folder
        shutil.rmtree(root)
        with pytest.raises(RunDirLostError, match=rf"checkpoint of step 60 refused: the checkpoints folder {root} is "
                                                 rf"gone \(removed while this job ran\), and with it step_00000050"):
            ck.save(str(root), 60, layers, opt, {"scaler": {}}, job=token)
        assert not root.exists()
        ck.save(str(tmp_path / "other"), 60, layers, opt, {"scaler": {}}, job="another-job")  # a first save: made
    finally:
        held.release()


def test_a_latest_that_is_a_directory_is_named_at_resume_and_left_at_save(one_rank_group, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Issue 38 item 6: resume went on without a word; the save then failed saying the checkpoint was not
    written (it was) and left latest.part behind."""
    root = tmp_path / "checkpoints"
    layers, opt = _layer()
    for step in (2, 4):
        ck.save(str(root), step, layers, opt, {"scaler": {}}, job="jobA")
    (root / ck.LATEST).unlink()
    (root / ck.LATEST).mkdir()
    (root / ck.LATEST / "mine.txt").write_text("kept")
    checkpoint_find._warned.clear()
    with caplog.at_level(logging.WARNING, logger="pipeflow"):
        assert ck.choose("auto", str(root)) == str(root / "step_00000004")
        assert ck.save(str(root), 6, layers, opt, {"scaler": {}}, job="jobA") == str(root / "step_00000006")
    said = [r.getMessage() for r in caplog.records]
    pointer = root / ck.LATEST
    assert any(m.startswith(f"{pointer} is a directory, not the file naming the newest checkpoint: ignored") and
               "move it away" in m for m in said), said
    assert any(m.startswith(f"{pointer} is a directory") and "left as it is, so it does not name "
               f"{root / 'step_00000006'} (saved and complete)" in m for m in said), said
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000004", "step_00000006"]  # no latest.part
    assert (pointer / "mine.txt").read_text() == "kept" and ck.find_latest(str(root)) == str(root / "step_00000006")


# ---------------------------------------------------------------------------- first failure
def test_a_first_failure_that_only_lost_a_peer_is_not_named_as_the_cause() -> None:
    cause = "rank 2: StageError: pipeline rank 2, stage 2, micro-batch 3, action 2F3: RuntimeError: boom"
    assert guard.first_failure_note(cause) == f"the first failure in this job was {cause}"
    gone = f"{guard.UNKNOWN_FIRST}the rendezvous store is gone (DistStoreError); its host ended"
    assert guard.first_failure_note(gone) == ("the job's first failure is not known here: the rendezvous store is "
                                              "gone (DistStoreError); its host ended")  # issue 57: was "... was unknown"
    survivor = ("rank 1: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
                "closed by peer [127.0.0.1]:3983")
    note = guard.first_failure_note(survivor)
    assert note.startswith(f"the first failure recorded in this job was {survivor}; that rank had only lost a peer")
    assert "ended without a record (killed, or died in native code)" in note and "exitcode" in note
    saving = "rank 0: CheckpointPeerLostError: checkpoint of step 4 not written (x): a peer stopped taking part while"
    assert guard.first_failure_note(saving).startswith("the first failure recorded in this job was")


class _StoppedStore:
    """A rendezvous store whose host is stopped (SIGSTOP): every call blocks for good."""

    def add(self, key: str, amount: int) -> int:
        threading.Event().wait()
        return 0


def test_recording_a_failure_never_waits_for_a_stopped_store_host() -> None:
    said: list = []
    started = time.monotonic()
    call = threading.Thread(target=lambda: said.append(
        guard.record_failure(RuntimeError("Connection closed by peer"), 1, _StoppedStore(), wait_s=0.2)), daemon=True)
    call.start()
    call.join(5.0)  # without the bound it blocks for good (a TCPStore call on a stopped host does)
    assert said == [None] and time.monotonic() - started < 2.0  # about 2 * wait_s


def test_keep_last_keeps_the_newest_complete_checkpoints_and_pinned_ones(one_rank_group, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """Issue 60: train.keep_last=K removes older complete checkpoints after each complete save; a
    pinned one (python -m pipeflow.checkpoint pin) stays, and so does a run's leftover partial save."""
    from pipeflow.errors import ConfigError
    from pipeflow.checkpoint import retention
    from pipeflow.checkpoint.exporting import main as checkpoint_main

    root = tmp_path / "checkpoints"
    layers, opt = _layer()
    ck.save(str(root), 1, layers, opt, {"scaler": {}}, job="jobA", keep_last=2)
    assert checkpoint_main(["pin", str(root / "step_00000001")]) == 0 and "pinned" in capsys.readouterr().out
    (root / "step_00000002.jobB.tmp").mkdir()  # another save's partial folder: not a checkpoint, not ours to remove
    for step in (2, 3, 4, 5):
        ck.save(str(root), step, layers, opt, {"scaler": {}}, job="jobA", keep_last=2)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["latest", "step_00000001", "step_00000002.jobB.tmp", "step_00000004", "step_00000005"], left
    assert ck.choose("auto", str(root)) == str(root / "step_00000005")
    assert checkpoint_main(["pin", "--unpin", str(root / "step_00000001")]) == 0
    assert retention.prune(str(root), 2) == [str(root / "step_00000001")]
    assert retention.prune(str(root), None) == []
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        retention.pin(str(root / "step_00000002.jobB.tmp"))
