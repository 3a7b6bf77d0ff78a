"""train.checkpoint_storage=local on 4 gloo ranks standing for 2 hosts (a host table of two
hosts, each host's ranks saving under a folder of their own: the disks of tests/test_hosts_storage.py
without namespaces): each host holds its own ranks' shards, ``.metadata``, digests and ``latest``;
a resume works in either order of hosts; a step some host lacks is skipped; gather merges the
parts into one checkpoint any layout loads, and refuses an incomplete set.  Also the start-up
check's verdicts (:func:`pipeflow.checkpoint.storage.sharing_problem`) and the config key."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_cases import _error, _on_rank0, _shared_dir  # noqa: E402
from mp_harness import run_cases  # noqa: E402

from pipeflow.errors import ConfigError, RunDirNotSharedError  # noqa: E402
from pipeflow.checkpoint import saving as checkpoint, storage  # noqa: E402
from pipeflow.checkpoint.gather import gather  # noqa: E402
from pipeflow.config.schema import check_values  # noqa: E402
from pipeflow.checkpoint.exporting import check_complete, read_layers  # noqa: E402
from pipeflow.runtime.world import hosts  # noqa: E402

TWO_HOSTS = hosts.HostTable((("h0", "10.0.0.1", (0, 1)), ("h1", "10.0.0.2", (2, 3))))
SWAPPED = hosts.HostTable((("h1", "10.0.0.2", (0, 1)), ("h0", "10.0.0.1", (2, 3))))


def _layers(stage: int, seed: int) -> tuple[dict[int, torch.nn.Module], torch.optim.Optimizer]:
    """Layer `stage` (a Linear) with AdamW state; dp replicas (same stage) hold the same values."""
    torch.manual_seed(seed * 10 + stage)
    layers = {stage: torch.nn.Linear(4, 4)}
    opt = torch.optim.AdamW(layers[stage].parameters(), lr=0.1)
    layers[stage](torch.ones(2, 4)).sum().backward()
    opt.step()
    return layers, opt


def _use(table: hosts.HostTable) -> None:
    hosts.remember(table)
    storage._PART = None  # the host groups of this table (collective)


def _save_failing_on_host1(root: str, stage: int) -> None:
    """Step 3, whose commit fails on host h1 (rank 2) after host h0 renamed its part into place."""
    real = checkpoint._commit_part

    def full(saving, meta) -> None:  # noqa: ANN001 - checkpoint._commit_part's own
        raise OSError(28, "No space left on device")

    checkpoint._commit_part = full if dist.get_rank() == 2 else real
    try:
        layers, opt = _layers(stage, 3)
        checkpoint.save(root, 3, layers, opt, {}, job="jobL", storage="local")
    finally:
        checkpoint._commit_part = real


class TwoLinears:
    """The run's model as export sees it (:func:`pipeflow.checkpoint.exporting.check_complete`): two layers
    with weights."""

    def __len__(self) -> int:
        return 2

    def build_all(self) -> list[torch.nn.Module]:
        return [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]


def local_save_resume_gather() -> dict:
    """dp 2 x pp 2 (rank = dp * 2 + stage), host h<i> saving under <base>/host<i>/checkpoints."""
    rank, base = dist.get_rank(), _shared_dir()
    stage, host = rank % 2, rank // 2
    roots = [os.path.join(base, f"host{i}", "checkpoints") for i in range(2)]
    _use(TWO_HOSTS)
    out: dict = {}
    for step in (1, 2):
        layers, opt = _layers(stage, step)
        checkpoint.save(roots[host], step, layers, opt, {"dp": 2, "pp": 2}, job="jobL", storage="local")
    saved = {k: v.clone() for k, v in layers[stage].state_dict().items()}
    out["failed"] = _error(lambda: _save_failing_on_host1(roots[host], stage))
    dist.barrier()  # each host's first rank has removed what its host wrote
    out["after_failure"] = sorted(os.listdir(roots[host])), open(os.path.join(roots[host], "latest")).read()
    if rank in (0, 2):
        final = os.path.join(roots[host], "step_00000002")
        out["files"] = sorted(os.listdir(final))
        out["latest"] = open(os.path.join(roots[host], "latest")).read()
        out["meta"] = checkpoint.read_meta(final)
    for table, name in ((TWO_HOSTS, "same"), (SWAPPED, "swapped")):
        _use(table)
        mine = roots[host] if table is TWO_HOSTS else roots[1 - host]
        path = storage.choose_local("auto", mine)
        fresh, opt = _layers(stage, 7)
        checkpoint.load(path, fresh, opt, "local")
        same = all(torch.equal(saved[k], v) for k, v in fresh[stage].state_dict().items())
        out[name] = (os.path.basename(path), same)
    _use(TWO_HOSTS)
    _on_rank0(lambda: shutil.rmtree(os.path.join(roots[1], "step_00000002")))  # host h1 never finished step 2
    out["partial"] = os.path.basename(storage.choose_local("auto", roots[host]) or "")
    if rank == 0:
        merged = os.path.join(base, "merged", "step_00000001")
        out["incomplete"] = _error(lambda: gather([os.path.join(roots[0], "step_00000001")], merged))
        gather([os.path.join(roots[0], "step_00000001"), os.path.join(roots[1], "step_00000001")], merged)
        out["merged"] = {k: v.clone() for k, v in read_layers(merged)[0].items()}, sorted(os.listdir(merged))
        out["merged_ok"] = checkpoint.verify(merged, collective=False)
    box = [os.path.join(base, "merged", "step_00000001")]
    dist.barrier()
    whole = {0: torch.nn.Linear(4, 4), 1: torch.nn.Linear(4, 4)}  # any layout: every rank both layers
    opt = torch.optim.AdamW([p for m in whole.values() for p in m.parameters()], lr=0.1)
    checkpoint.load(box[0], whole, opt)
    ref, _ = _layers(stage, 1)
    out["merged_load"] = all(torch.equal(ref[stage].state_dict()[k], v) for k, v in whole[stage].state_dict().items())
    # pp outermost (rank = stage * 2 + dp): host h0's ranks 0-1 hold stage 0 alone; its part is half the model
    across = [os.path.join(base, "across", f"host{i}", "checkpoints") for i in range(2)]
    layers, opt = _layers(rank // 2, 1)
    checkpoint.save(across[host], 1, layers, opt, {"dp": 2, "pp": 2}, job="jobP", storage="local")
    if rank == 0:
        part, whole_part = os.path.join(across[0], "step_00000001"), os.path.join(roots[0], "step_00000001")
        out["half_export"] = _error(lambda: check_complete(part, read_layers(part), TwoLinears()))
        out["whole_export"] = check_complete(whole_part, read_layers(whole_part), TwoLinears())
    dist.barrier()
    _on_rank0(lambda: shutil.rmtree(base, ignore_errors=True))
    hosts.remember(hosts.HostTable())
    return out


@pytest.fixture(scope="module")
def world() -> dict:
    return run_cases(4, [("local", local_save_resume_gather)])


def test_local_storage_saves_each_hosts_part_resumes_in_any_host_order_and_gathers(world) -> None:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(world["local"]) if res.error]
    assert not errors, "\n".join(errors)
    values = [res.value for res in world["local"]]
    for rank, files in ((0, ["__0_0.distcp", "__1_0.distcp"]), (2, ["__2_0.distcp", "__3_0.distcp"])):
        out = values[rank]
        assert out["files"] == [".metadata", *files, "meta.json", "rng"], out["files"]
        assert out["latest"] == "step_00000002"
        meta = out["meta"]
        assert meta["storage"] == "local" and meta["host_ranks"] == [rank, rank + 1] and meta["world_size"] == 4
        assert sorted(meta["files"]) == [".metadata", *files, f"rng/rank{rank}.pt", f"rng/rank{rank + 1}.pt"]
    for out in values:
        assert out["failed"].startswith("CheckpointError: checkpoint of step 3 not written"), out["failed"]
        assert "committing its host's part failed on rank 2: OSError: [Errno 28] No space left" in out["failed"]
        assert out["after_failure"] == (["latest", "step_00000001", "step_00000002"], "step_00000002"), out
        assert out["same"] == ("step_00000002", True) and out["swapped"] == ("step_00000002", True), out
        assert out["partial"] == "step_00000001"  # a step one host lacks is no checkpoint
        assert out["merged_load"]
    main = values[0]
    assert "global ranks 2-3" in main["incomplete"] and "host h1" in main["incomplete"], main["incomplete"]
    # issue 57: export refuses one host's part that lacks layers (it wrote 8 of 16 tensors with rc 0)
    half = main["half_export"]
    assert half.startswith("CheckpointError: checkpoint ") and "is host h0's part of step 1" in half, half
    assert "global ranks 0-1" in half and "lacks layers 1 of the run's model (2 layers)" in half, half
    assert "python -m pipeflow.checkpoint gather" in half, half
    assert main["whole_export"] is None  # a part holding a whole replica exports
    assert main["merged_ok"] is None
    assert main["merged"][1] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
                                 "meta.json", "rng"]


ROWS = [("a", (0, 1)), ("b", (2, 3))]


def test_hosts_with_their_own_disks_are_refused_with_shared_storage_naming_what_each_sees() -> None:
    err = storage.sharing_problem("/r", ROWS, [[0], [1]], "shared")
    assert isinstance(err, RunDirNotSharedError)
    text = str(err)
    assert "host a (global ranks 0-1) sees the files of a (its own)" in text, text
    assert "host b (global ranks 2-3) sees the files of b (its own)" in text, text
    assert "train.checkpoint_storage=local" in text, text


def test_the_sharing_verdicts() -> None:
    assert storage.sharing_problem("/r", ROWS, [[0, 1], [0, 1]], "shared") is None
    assert storage.sharing_problem("/r", ROWS, [[0], [1]], "local") is None
    assert isinstance(storage.sharing_problem("/r", ROWS, [[0, 1], [0, 1]], "local"), RunDirNotSharedError)
    assert "not writable" in str(storage.sharing_problem("/r", ROWS, [[0, 1], []], "shared"))


def test_checkpoint_storage_takes_shared_or_local() -> None:
    from omegaconf.errors import ValidationError

    from pipeflow.config.schema import Config, MLPModelConfig, TrainConfig
    cfg = OmegaConf.structured(Config(model=MLPModelConfig()))
    check_values(cfg)
    with pytest.raises(ValidationError, match=r"Invalid value 'nfs', expected one of \[shared, local\]"):
        cfg.train.checkpoint_storage = "nfs"  # a choice: refused where it is set
    with pytest.raises(ConfigError, match="train.checkpoint_storage='nfs' is not one of shared, local"):
        TrainConfig(checkpoint_storage="nfs")
