"""Save failures on 2 gloo ranks, run inside tests/test_faults.py's world (see mp_harness): a full
disk on one rank, a run-directory lock that vanished or changed hands, a peer lost mid-save, the
deadline the save's collectives wait with after the first step, and a run directory removed while
training (both ranks stop at the same step).

Not collected on its own: the ``test_*`` functions below are imported by test_faults.py, whose
``world`` fixture has run the cases (:data:`WORLD_CASES`) once for the whole module.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem as dcp_fs

from fault_cases import _error, _on_rank0, _shared_dir

FULL = os.strerror(errno.ENOSPC)  # "No space left on device"


def _model() -> tuple[dict[int, torch.nn.Module], torch.optim.Optimizer]:
    """Rank r holds layer r (a Linear) with AdamW state."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    layers = {rank: torch.nn.Linear(4, 4)}
    opt = torch.optim.AdamW(layers[rank].parameters(), lr=0.1)
    layers[rank](torch.ones(2, 4)).sum().backward()
    opt.step()
    return layers, opt


@contextlib.contextmanager
def _disk_full(where: str, on_rank: int) -> Iterator[None]:
    """On rank `on_rank`, writes fail with ENOSPC: DCP's data files (``data``), this rank's RNG
    file (``rng``) or rank 0's ``meta.json`` (``meta``)."""
    from pipeflow.checkpoint import saving as ck

    real_stream, real_save, real_atomic = dcp_fs.FileSystem.create_stream, torch.save, ck.write_atomic

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, FULL)

    @contextlib.contextmanager
    def stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with real_stream(self, path, mode) as opened:
            if str(path).endswith(".distcp"):
                opened.write = full
            yield opened

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if "/rng/" in str(f):
            full()
        return real_save(obj, f, *args, **kwargs)

    def atomic(path: str, text: str) -> None:
        if path.endswith("meta.json"):
            raise OSError(errno.ENOSPC, FULL, path + ".part")
        real_atomic(path, text)

    if dist.get_rank() == on_rank:
        patch = {"data": (dcp_fs.FileSystem, "create_stream", stream), "rng": (torch, "save", save),
                 "meta": (ck, "write_atomic", atomic)}[where]
        setattr(*patch)
    try:
        yield
    finally:
        dcp_fs.FileSystem.create_stream, torch.save, ck.write_atomic = real_stream, real_save, real_atomic


def save_on_a_full_disk() -> dict[str, Any]:
    """Step 1 saved; step 2's save meets a full disk on one rank, in each of its writes; then a
    save works again.  Returns every error text and what the checkpoints folder held after."""
    from pipeflow.checkpoint import saving as ck

    layers, opt = _model()
    root = _shared_dir()
    out: dict[str, Any] = {"root": root}
    try:
        ck.save(root, 1, layers, opt, {"scaler": {}}, job="jobA")
        for where, on_rank in (("data", 1), ("rng", 1), ("meta", 0)):
            with _disk_full(where, on_rank):
                out[where] = _error(lambda: ck.save(root, 2, layers, opt, {"scaler": {}}, job="jobA"))
            dist.barrier()
            out[f"{where}_left"] = sorted(os.listdir(root))
            out[f"{where}_latest"] = os.path.basename(ck.find_latest(root))
        out["after"] = os.path.basename(ck.save(root, 2, layers, opt, {"scaler": {}}, job="jobA"))
    finally:
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    return out


def save_with_a_lost_lock() -> dict[str, Any]:
    """Rank 0 holds the run directory's lock (as a Workspace does); the lock file is deleted, then
    names another job, then the run directory is removed: each save after is refused on every
    rank and writes nothing."""
    import json

    from pipeflow.checkpoint import saving as ck
    from pipeflow.checkpoint.lock import LOCK_FILE, RunLock

    layers, opt = _model()
    run_dir = _shared_dir()
    root, lock_file = os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, LOCK_FILE)
    held = RunLock(run_dir) if dist.get_rank() == 0 else None
    box = [held.acquire() if held is not None else None]
    dist.broadcast_object_list(box, src=0)
    token = box[0]
    out: dict[str, Any] = {"run_dir": run_dir}
    try:
        out["held"] = os.path.basename(ck.save(root, 1, layers, opt, {"scaler": {}}, job=token))
        foreign = json.dumps({"host": "node-7", "pid": 4242, "token": "theirs"})
        for case, damage in (("gone", lambda: os.remove(lock_file)),
                             ("foreign", lambda: open(lock_file, "w").write(foreign)),
                             ("dir_removed", lambda: shutil.rmtree(run_dir))):
            _on_rank0(damage)
            out[case] = _error(lambda: ck.save(root, 2, layers, opt, {"scaler": {}}, job=token))
            out[f"{case}_left"] = sorted(os.listdir(root)) if os.path.isdir(root) else None
        out["dir_made_again"] = os.path.exists(run_dir)
    finally:
        if held is not None:
            held.release()
        _on_rank0(lambda: shutil.rmtree(run_dir, ignore_errors=True))
    return out


def save_losing_a_peer() -> dict[str, Any]:
    """The all-gather that ends the save's writes fails on both ranks as gloo fails when a peer
    died (faked on both, so the group stays usable): a named error, the partial folder removed."""
    from pipeflow.checkpoint import saving as ck
    from pipeflow.checkpoint.integrity import Outcome

    layers, opt = _model()
    root = _shared_dir()
    real, calls = dist.all_gather_object, []

    def gather(everyone: list, mine: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(isinstance(mine, Outcome))
        if sum(calls) == 2:  # the save's first agreement is "preparing", its second ends the writes
            # as the real all-gather, only once both ranks are done writing: else rank 0 removed
            # the partial folder while rank 1 still wrote its RNG file there (seen once in CI)
            dist.barrier()
            raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
                               "peer [127.0.0.1]:4321. This is typically caused by a remote worker crashing.")
        return real(everyone, mine, *args, **kwargs)

    out: dict[str, Any] = {"root": root}
    try:
        ck.save(root, 1, layers, opt, {"scaler": {}}, job="jobA")
        dist.all_gather_object = gather
        try:
            out["error"] = _error(lambda: ck.save(root, 2, layers, opt, {"scaler": {}}, job="jobA"))
        finally:
            dist.all_gather_object = real
        dist.barrier()
        out["left"] = sorted(os.listdir(root))
    finally:
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    return out


def save_deadline_after_the_first_step() -> list[float | None]:
    """The process-group timeout in force at each of the save's collectives, once the run's
    Deadlines (first step 120 s, then 2 s) switched after the first step."""
    from pipeflow.checkpoint import saving as ck
    from pipeflow.runtime.world import timeouts
    from pipeflow.runtime.transport import Deadlines

    layers, opt = _model()
    root = _shared_dir()
    seen: list[float | None] = []
    real_gather, real_save = dist.all_gather_object, ck.dcp.save

    def gather(*args: Any, **kwargs: Any) -> Any:
        seen.append(timeouts.group_timeout_s(None))
        return real_gather(*args, **kwargs)

    def dcp_save(*args: Any, **kwargs: Any) -> Any:
        seen.append(timeouts.group_timeout_s(None))
        return real_save(*args, **kwargs)

    deadlines = Deadlines(120.0, 2.0, collectives=True)
    deadlines.first_step_done()
    dist.all_gather_object, ck.dcp.save = gather, dcp_save
    try:
        ck.save(root, 1, layers, opt, {"scaler": {}}, job="jobA")
    finally:
        dist.all_gather_object, ck.dcp.save = real_gather, real_save
        timeouts.set_group_timeout(None, 60.0)  # the harness's own timeout, for the cases after
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    return seen


def training_with_the_run_dir_removed() -> dict[str, Any]:
    """A 2-stage GPT on both ranks; after step 1 rank 0 removes the run directory: its lock watch
    sees it (every 0.02 s here), the flag rides the next step's all-reduce, and both ranks raise
    RunDirLostError at the same step (rank 1 holds no lock: it finds the loss itself)."""
    import time

    import scale_cases
    from pipeflow.checkpoint import lock
    from pipeflow.run.builder import build_run
    from pipeflow.runtime.world import timeouts

    watch_s, lock.WATCH_S = lock.WATCH_S, 0.02
    parent = _shared_dir()
    run_dir = os.path.join(parent, "run")
    cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=run_dir, train__max_steps=400, train__save_every=0,
                                  metrics__memory_steps=[])
    trainer = build_run(cfg, torch.device("cpu"))
    try:
        trainer.advance(0, late=False)
        if dist.get_rank() == 0:
            shutil.rmtree(run_dir)
            deadline = time.monotonic() + 2.0
            while not trainer.loop.workspace.lost and time.monotonic() < deadline:
                time.sleep(0.01)
        error = _error(lambda: trainer._train(1))
        return {"run_dir": run_dir, "error": error, "steps": len(trainer.history),
                "made_again": os.path.exists(run_dir)}
    finally:
        lock.WATCH_S = watch_s
        trainer.close()
        timeouts.set_group_timeout(None, 60.0)  # the harness's own timeout, for the cases after
        _on_rank0(lambda: shutil.rmtree(parent, ignore_errors=True))


WORLD_CASES = [
    ("save-disk-full", save_on_a_full_disk),
    ("save-lock-lost", save_with_a_lost_lock),
    ("save-peer-lost", save_losing_a_peer),
    ("save-deadline", save_deadline_after_the_first_step),
    ("run-dir-removed", training_with_the_run_dir_removed),
]


# ------------------------------------------------------------- assertions (run by test_faults.py)
def _values(results: list) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


def test_a_full_disk_on_one_rank_names_its_errno_on_every_rank_and_removes_the_partial_folder(world) -> None:
    for out in _values(world["save-disk-full"]):
        root = out["root"]
        for where, rank, doing in (("data", 1, "writing its files"), ("rng", 1, "writing its files"),
                                   ("meta", 0, "committing it")):
            text = out[where]
            assert text.startswith(f"CheckpointError: checkpoint of step 2 not written ({root}/step_00000002.jobA.tmp): "
                                   f"{doing} failed on rank {rank}: OSError: [Errno 28] {FULL}"), text
            assert "the file system is full: free space there, or point train.run_dir at another disk" in text, text
            assert f"the partial folder was removed, latest still names {root}/step_00000001" in text, text
            assert out[f"{where}_left"] == ["latest", "step_00000001"], (where, out[f"{where}_left"])
            assert out[f"{where}_latest"] == "step_00000001"
        assert "rank 0:" not in out["data"]  # only the rank whose disk was full is named
        assert out["after"] == "step_00000002"  # the group and the folder are fine for the next save


def test_a_save_with_a_lost_or_foreign_lock_stops_every_rank_and_writes_nothing(world) -> None:
    for out in _values(world["save-lock-lost"]):
        run_dir = out["run_dir"]
        assert out["held"] == "step_00000001"
        assert out["gone"].startswith(f"RunDirLostError: checkpoint of step 2 refused: this job's lock "
                                      f"{run_dir}/pipeflow.lock is gone"), out["gone"]
        assert out["foreign"].startswith(f"RunDirLostError: checkpoint of step 2 refused: {run_dir}/pipeflow.lock "
                                         f"now names another job: pid 4242 on host node-7"), out["foreign"]
        for text in (out["gone"], out["foreign"]):
            assert f"train.resume=auto train.run_dir={run_dir}" in text and "this job stops" in text
        assert out["gone_left"] == out["foreign_left"] == ["latest", "step_00000001"]  # nothing written
        assert out["dir_removed"].startswith(f"RunDirLostError: checkpoint of step 2 refused: run directory {run_dir} "
                                             f"no longer exists"), out["dir_removed"]
        assert out["dir_removed_left"] is None and not out["dir_made_again"]


def test_a_peer_lost_during_a_save_is_a_named_checkpoint_error(world) -> None:
    for out in _values(world["save-peer-lost"]):
        root, text = out["root"], out["error"]
        assert text.startswith(f"CheckpointPeerLostError: checkpoint of step 2 not written ({root}/step_00000002.jobA.tmp): "
                               f"a peer stopped taking part while writing its files (it died, was stopped, or hangs"), text
        assert "Connection closed by peer" in text and f"latest still names {root}/step_00000001" in text, text
        assert out["left"] == ["latest", "step_00000001"], out["left"]


def test_a_run_dir_removed_while_training_stops_every_rank_at_the_same_step(world) -> None:
    """Issue 38 item 7: the job trained on (440 steps in one case) until its next save noticed."""
    outs = _values(world["run-dir-removed"])
    run_dir = outs[0]["run_dir"]
    said = [re.match(rf"RunDirLostError: training stopped at step (\d+): run directory {re.escape(run_dir)} no "
                     rf"longer exists \(removed while this job ran\); the job stops", out["error"]) for out in outs]
    assert all(said), outs
    assert len({m.group(1) for m in said}) == 1 and int(said[0].group(1)) <= 3, outs  # the same step, at once
    assert all(out["steps"] == outs[0]["steps"] and not out["made_again"] for out in outs), outs


def test_the_saves_collectives_wait_with_the_steady_deadline_after_the_first_step(world) -> None:
    for seen in _values(world["save-deadline"]):
        assert len(seen) >= 5 and set(seen) == {2.0 + 15.0}, seen  # comm.timeout_s + margin, not first_step's
