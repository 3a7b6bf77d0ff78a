"""Failures become named errors, never hangs: config checks, agreement, stage faults, OOM, and
jobs with an injected fault (PIPEFLOW_FAULT_INJECT) that must exit non-zero, promptly, naming the
culprit, with no process left behind (train.py on warm forks; torchrun where its agent is the subject)."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import async_checkpoint_cases
import checkpoint_cases
import fault_cases as cases
import replan_cases
from replan_cases import (  # noqa: F401 - parallel.replan (issue 61), run on this module's world
    test_a_replanning_run_chooses_its_degrees_keeps_its_plan_and_restarts_on_it,
    test_a_folder_travels_between_ranks_a_chunk_at_a_time,
    test_dropout_draws_the_same_masks_on_every_layout,
)
from async_checkpoint_cases import (  # noqa: F401 - background saves (issue 60), run on this module's world
    test_a_background_save_given_up_never_commits_and_latest_names_the_newer_save,
    test_a_full_disk_during_a_background_write_is_named_on_every_rank_and_latest_stays,
    test_a_killed_writer_process_is_named_on_every_rank_and_the_next_save_starts_anew,
    test_async_checkpoints_hold_the_files_a_synchronous_save_writes,
    test_async_process_checkpoints_hold_the_files_a_synchronous_save_writes,
    test_the_trainer_saves_in_the_background_as_it_saves_in_the_foreground,
)
from checkpoint_cases import (  # noqa: F401 - save-failure tests, run on this module's world
    test_a_full_disk_on_one_rank_names_its_errno_on_every_rank_and_removes_the_partial_folder,
    test_a_peer_lost_during_a_save_is_a_named_checkpoint_error,
    test_a_run_dir_removed_while_training_stops_every_rank_at_the_same_step,
    test_a_save_with_a_lost_or_foreign_lock_stops_every_rank_and_writes_nothing,
    test_the_saves_collectives_wait_with_the_steady_deadline_after_the_first_step,
)
import warm
from warm_exec import interpreters
from mp_harness import CaseResult, run_cases
from pipeflow.run import guard
from pipeflow.runtime import failures
from pipeflow.config.schema import check_config
from pipeflow.errors import ConfigError, ScheduleError, StageError, StageOutOfMemoryError
from pipeflow.run.faults import FaultSpec
from pipeflow.schedules import build_schedule, lower, one_f_one_b
from pipeflow.data import build_batches
from test_cli import compose_config

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["comm.timeout_s=0"], r"comm.timeout_s=0.0 must be > 0"),
        (["comm.timeout_s=10", "comm.first_step_timeout_s=5"], r"first_step_timeout_s=5.0 is shorter.*>=10.0"),
        (["data=text", "data.path=/no/such/file.txt"], r"data.path='/no/such/file.txt' is not a file"),
        (["schedule=custom", "schedule.path=/no/such/schedule.txt"], r"schedule.path='/no/such/schedule.txt' is not a file"),
        (["comm.recvs_ahead=sometimes"], r"comm.recvs_ahead='sometimes' must be true, false or auto"),
        (["comm.recvs_ahead=1"], r"comm.recvs_ahead=1 must be true, false or auto"),
        (["parallel.dp=auto"], r"parallel.dp=auto needs parallel.pp .*parallel.pp=2"),
        (["parallel.dp=auto", "parallel.pp=3"], r"parallel.dp=auto: parallel.pp=3 = 3 ranks per replica does not divide"),
        (["parallel.dp=two"], r"parallel.dp='two' must be a whole number"),
        # issue 38: counts below their least value were accepted (tp=0 ran as tp 1) or blamed another key
        (["parallel.tp=0"], r"^parallel.tp=0 must be at least 1 \(ranks per stage; 1: no tensor parallelism\)$"),
        (["parallel.pp=0"], r"^parallel.pp=0 must be at least 1 \(pipeline ranks; null: world size"),
        (["parallel.dp=0"], r"^parallel.dp=0 must be at least 1 \(data-parallel replicas; auto: world size / \(pp x tp\)\)$"),
        (["schedule.stages_per_rank=0"], r"^schedule.stages_per_rank=0 must be at least 1 \(model chunks per rank"),
        (["train.log_every=0"], r"^train.log_every=0 must be at least 1"),
        (["train.eval_every=-1"], r"^train.eval_every=-1 must be >= 0 \(0: never evaluate\)$"),
        (["train.eval_batches=-1"], r"^train.eval_batches=-1 must be >= 0"),
        (["metrics.timed_every=0"], r"^metrics.timed_every=0 must be at least 1"),
        (["comm.first_step_timeout_s=nan"], r"^comm.first_step_timeout_s=nan must be > 0 seconds \(default 900\)$"),
        (["comm.join_timeout_s=inf"], r"^comm.join_timeout_s=inf must be a finite number of seconds \(default 120\)"),
    ],
)
def test_config_errors_say_what_to_change(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(compose_config(*overrides), world_size=2)


class _Failed(Exception):
    """What the stand-in for guard.fail raises, carrying the error train.py would have reported."""


def test_train_py_refuses_bad_deadlines_and_counts_before_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    """comm.join_timeout_s=0 was reported on rank 0 as 'rank 0, which hosts it, never arrived'
    (issue 38): train.py checks the counts and deadlines before it joins, naming the key, and the
    join itself refuses a deadline that is no deadline."""
    import importlib.util
    import types

    from pipeflow.runtime.world.distributed import join_store

    spec = importlib.util.spec_from_file_location("pipeflow_train_entry", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    joined: list[tuple] = []

    def fail(exc: BaseException, rank: int) -> None:
        raise _Failed(exc)

    monkeypatch.setattr(train, "init_distributed", lambda *args: joined.append(args))
    monkeypatch.setattr(train.guard, "fail", fail)
    monkeypatch.setattr(train, "setup_logging", lambda rank: None)
    monkeypatch.setattr(train, "faulthandler", types.SimpleNamespace(enable=lambda **kw: None))
    for override, message in [("comm.join_timeout_s=0", r"^comm.join_timeout_s=0.0 must be > 0 seconds"),
                              ("parallel.tp=0", r"^parallel.tp=0 must be at least 1")]:
        with pytest.raises(_Failed) as caught:
            train.main(compose_config(override))  # Hydra's main runs a config handed to it as is
        error = caught.value.args[0]
        assert isinstance(error, ConfigError) and re.match(message, str(error)), error
    assert joined == []  # no rank waited for a peer, nor blamed one
    with pytest.raises(ConfigError, match=r"^comm.join_timeout_s=0.0 must be a finite number of seconds > 0"):
        join_store(0, 2, 0.0)


def _with_resume(value: str):
    """The default config with ``train.resume`` (a key the checkpoint work adds) set to `value`."""
    cfg = OmegaConf.create(OmegaConf.to_container(compose_config(), resolve=True))
    cfg.train.resume = value
    return cfg


def test_resume_must_be_auto_or_an_existing_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train.resume='/no/such/ckpt' does not exist.*train.resume=auto"):
        check_config(_with_resume("/no/such/ckpt"), world_size=2)
    assert check_config(_with_resume("auto"), world_size=2) == (1, 2)
    assert check_config(_with_resume(str(tmp_path)), world_size=2) == (1, 2)


def test_parallel_dp_auto_fills_the_world_with_replicas_of_the_pipeline() -> None:
    cfg = compose_config("parallel.dp=auto", "parallel.pp=2", "data.batch_size=32")
    assert [check_config(cfg, world) for world in (2, 4, 8)] == [(1, 2), (2, 2), (4, 2)]
    assert check_config(compose_config("parallel.dp=auto", "parallel.pp=1", "parallel.tp=2", "data.batch_size=16"), 4) == (2, 1)


def test_existing_paths_pass(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("hello")
    assert check_config(compose_config("data=text", f"data.path={text}"), world_size=2) == (1, 2)


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ScheduleError, match=r"unknown placement 'zigzag'; valid: loop, v \(schedule.placement\)"):
        build_schedule("interleaved_1f1b", 2, 4, placement="zigzag")
    with pytest.raises(ConfigError, match=r"unknown data.name='imagenet'; valid: markov, text, gaussian, cifar10"):
        build_batches(compose_config("data.name=imagenet").data, None)
    for override, allowed in (("train.param_dtype=fp8", "float32, float64, bfloat16, float16"),
                              ("dist.backend=ncll", "nccl, gloo, mpi, ucc"),
                              ("parallel.shard=zero3", "none, optimizer, full")):  # choices: refused composing
        with pytest.raises(Exception, match=override) as info:
            compose_config(override)
        assert f"expected one of [{allowed}]" in str(info.value.__cause__)


def test_config_differences_name_keys_values_and_ranks() -> None:
    base = guard.flatten_config(compose_config())
    other = guard.flatten_config(compose_config("pipeline.num_microbatches=4", "schedule=gpipe"))
    assert base["pipeline.num_microbatches"] == 8 and "model.n_layer" in base
    per_rank = [(guard.config_hash(f), f) for f in (base, other, base)]
    text = guard.config_differences(per_rank)
    assert "pipeline.num_microbatches: 8 on ranks 0, 2; 4 on rank 1" in text
    assert 'schedule.name: "1f1b" on ranks 0, 2; "gpipe" on rank 1' in text
    assert "model.n_layer" not in text  # equal keys are not listed
    assert per_rank[0][0] == per_rank[2][0] != per_rank[1][0]


# ---------------------------------------------------------------------------- error content
def test_fault_spec_parses_and_rejects_bad_text() -> None:
    assert FaultSpec.parse("stall:rank=1:step=2") == FaultSpec("stall", 1, 2)
    assert FaultSpec.parse("raise:rank=2:step=0:microbatch=3:stage=5") == FaultSpec("raise", 2, 0, 3, 5)
    with pytest.raises(ConfigError, match="unknown fault 'sleep'; valid: stall, raise"):
        FaultSpec.parse("sleep:rank=1:step=2")
    with pytest.raises(ConfigError, match="needs rank=R and step=K"):
        FaultSpec.parse("kill:rank=1")


def test_a_hold_waits_until_its_file_is_removed(monkeypatch, tmp_path) -> None:
    """The `hold` fault keeps the forward of its step waiting while its file exists (a test's
    handle on a job it must act on at a known step) and is refused without the file's name."""
    import threading

    from pipeflow.run.faults import HOLD_VAR, FaultInjector

    monkeypatch.delenv(HOLD_VAR, raising=False)
    with pytest.raises(ConfigError, match=f"set {HOLD_VAR}=<path>"):
        FaultSpec.parse("hold:rank=0:step=3")
    held = tmp_path / "held"
    held.touch()
    monkeypatch.setenv(HOLD_VAR, str(held))
    injector = FaultInjector(FaultSpec.parse("hold:rank=0:step=3"), 0)
    injector.step = 3
    released = threading.Timer(0.3, held.unlink)
    released.start()
    start = time.monotonic()
    injector._pre_forward(type("Stage", (), {"index": 0})(), 0)
    assert time.monotonic() - start >= 0.25
    released.join()


def test_progress_note_lists_the_last_actions_done() -> None:
    program = lower(one_f_one_b(2, 4))[1]  # rank 1: every step computes, 1F0 1B0 1F1 1B1 ...
    assert failures.progress_note(program, 0) == "this rank had not run any action of this pass yet"
    note = failures.progress_note(program, 5)
    assert note.startswith(f"this rank had completed 5 of {len(program)} program steps")
    assert note.endswith("last actions: 1B0, 1F1, 1B1, 1F2")


class _FakeStage:
    def __init__(self, held: int) -> None:
        self.weight = torch.nn.Parameter(torch.zeros(256, 256))  # 0.25 MiB
        self.weight.grad = torch.zeros_like(self.weight)
        self.held = held

    def activations_held(self) -> int:
        return self.held

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight]


def test_out_of_memory_becomes_a_named_error_with_memory_and_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    stages = {2: _FakeStage(3), 5: _FakeStage(1)}
    where = "pipeline rank 1, stage 2, micro-batch 4, action 2F4"
    error = failures.stage_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), where, stages, torch.device("cpu"))
    assert isinstance(error, StageOutOfMemoryError) and isinstance(error, StageError)
    text = str(error)
    assert text.startswith(f"out of memory at {where}: OutOfMemoryError: CUDA out of memory")
    assert "activations are held for backward: stage 2: 3, stage 5: 1" in text
    assert "parameters 0.00 GiB" in text and "pipeline.num_microbatches" in text and "activation checkpointing" in text
    assert "pipeline.balance=memory" in text
    # on CUDA the allocator's figures are included (faked here: no GPU on the test machine)
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 38 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 31 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (gib // 2, 40 * gib))
    report = failures.memory_report(stages, torch.device("cuda:1"))
    assert "cuda:1: 30.00 GiB allocated, of which 30.00 GiB beyond parameters and gradients" in report
    assert "38.00 GiB reserved, peak 31.00 GiB, 0.50 GiB free of 40.00 GiB" in report


def test_only_memory_errors_are_treated_as_out_of_memory() -> None:
    assert failures.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert failures.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert not failures.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    error = failures.stage_failure(ValueError("bad"), "pipeline rank 0, stage 0, micro-batch 1, action 0F1", {}, torch.device("cpu"))
    assert type(error) is StageError and str(error) == "pipeline rank 0, stage 0, micro-batch 1, action 0F1: ValueError: bad"


def test_first_failure_is_written_once_and_read_back() -> None:
    store = dist.HashStore()
    assert guard.record_failure(RuntimeError("layer exploded"), 2, store) is None
    assert guard.record_failure(RuntimeError("peer closed"), 0, store) == "rank 2: RuntimeError: layer exploded"
    assert guard.record_failure(RuntimeError("x"), 1, store="not a store") is None  # never raises


# ------------------------------------------------------------------ 2 gloo processes, in-process
def _world_cases() -> list[tuple[str, object]]:
    return [
        ("same-config", functools.partial(cases.config_agreement, False)),
        ("config-mismatch", functools.partial(cases.config_agreement, True)),
        ("program-mismatch", cases.program_agreement),
        ("weights-in-profile", cases.weights_error_in_the_profile),
        ("weights-in-one-build", cases.weights_error_in_one_ranks_build),
        ("fault-raise", functools.partial(cases.stage_fault, "raise")),
        ("fault-oom", functools.partial(cases.stage_fault, "oom")),
        ("fault-dtype", functools.partial(cases.stage_fault, "dtype")),
        ("fault-shape", functools.partial(cases.stage_fault, "shape")),
        ("first-failure", cases.first_failure_is_shared),
        ("checkpoint-integrity", cases.checkpoint_integrity),
        ("trial-forward", cases.trial_forward_fault),
        ("post-failure", cases.post_failure),
        ("global-rank-named", cases.peers_named_by_global_rank),
        ("sweep-one-fails", cases.sweep_build_fails_on_rank_1),
        ("sweep-none-fails", cases.sweep_build_everywhere),
        ("nan-forward", functools.partial(cases.stage_fault, "nan", check_finite=True)),
        ("nan-backward", functools.partial(cases.stage_fault, "none", check_finite=True, nan_grad_stage=1)),
        ("nan-unchecked", functools.partial(cases.stage_fault, "nan")),
        ("nan-input", functools.partial(cases.nan_input_blamed, True)),
        ("finite-input", functools.partial(cases.nan_input_blamed, False)),
        ("dp-peer-stops", cases.dp_peer_stops_answering),
        ("tp-peer-lost", cases.tp_peer_lost),
        ("ep-peer-lost", cases.ep_peer_lost),
        *checkpoint_cases.WORLD_CASES,
        *async_checkpoint_cases.WORLD_CASES,
        *replan_cases.WORLD_CASES,
    ]


@pytest.fixture(scope="module")
def world() -> dict[str, list[CaseResult]]:
    return run_cases(2, _world_cases())


def _values(results: list[CaseResult]) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


def test_ranks_with_the_same_config_agree(world) -> None:
    hashes = _values(world["same-config"])
    assert len(set(hashes)) == 1 and re.fullmatch(r"[0-9a-f]{12}", hashes[0])


def test_ranks_started_with_different_overrides_stop_with_the_difference(world) -> None:
    for text in _values(world["config-mismatch"]):  # every rank raises the same error
        assert text.startswith("ConfigMismatchError: the ranks were started with different configs")
        assert "pipeline.num_microbatches: 8 on rank 0; 4 on rank 1" in text
        assert "comm.timeout_s: 300.0 on rank 0; 60.0 on rank 1" in text
        assert re.search(r"config hashes: [0-9a-f]{12} on rank 0; [0-9a-f]{12} on rank 1", text)
        assert "train.run_dir" not in text  # differs too, but rank 0's is broadcast


def test_a_weights_error_found_by_one_rank_is_raised_on_every_rank(world) -> None:
    """Issue 38: a layer whose loaded weights hold NaN (or lack a tensor) was named by the one rank
    that loads it: rank 0, which profiles every layer (rank 1 then waited in the profiles'
    broadcast for a CommError), or with pipeline.profile=false the rank that owns the layer."""
    for name in ("weights-in-profile", "weights-in-one-build"):  # pipeline.profile=true (default), false
        for text in _values(world[name]):
            assert text.startswith("CheckpointError: layer 'head': tensor 'lm_head.weight' in /models/x/model.safetensors "
                                   "holds 1 NaN"), (name, text)


def test_ranks_that_built_different_schedules_stop_before_communicating(world) -> None:
    for text in _values(world["program-mismatch"]):
        assert text.startswith("ScheduleError: the ranks built different pipelines")
        assert "rank 0: schedule 1f1b p=2 stages=2 m=4" in text and "rank 1: schedule 1f1b p=2 stages=2 m=8" in text


def test_exception_in_a_layer_names_rank_stage_microbatch_and_keeps_the_cause(world) -> None:
    for rank, text in enumerate(_values(world["fault-raise"])):
        assert text.startswith("StageError: pipeline rank 0, stage 0, micro-batch 1, action 0F1: RuntimeError: injected failure")
        assert text.endswith("| cause: RuntimeError")


def test_out_of_memory_in_a_stage_is_named_with_the_activations_held(world) -> None:
    for text in _values(world["fault-oom"]):
        assert text.startswith("StageOutOfMemoryError: out of memory at pipeline rank 0, stage 0, micro-batch 1, action 0F1")
        assert "activations are held for backward: stage 0: 1, stage 1: 0" in text  # 0F0 awaits 0B0
        assert "activation checkpointing" in text and text.endswith("| cause: OutOfMemoryError")


def test_wrong_dtype_names_both_stages_and_dynamic_shapes(world) -> None:
    for text in _values(world["fault-dtype"]):
        assert text.startswith("ShapeMismatchError: stage 0 (rank 0) produced outputs ['[4, 16] float32, grad']")
        assert "stage 1 (rank 0) expects ['[4, 16] float64, grad']" in text
        assert "comm.shapes=per_step" in text


def test_wrong_shape_names_both_stages_and_dynamic_shapes(world) -> None:
    for text in _values(world["fault-shape"]):
        assert "produced outputs ['[2, 16] float64, grad'] for micro-batch 1" in text
        assert "stage 1 (rank 0) expects ['[4, 16] float64, grad']" in text and "comm.shapes=per_step" in text


def test_non_finite_forward_is_traced_to_the_stage_that_produced_it(world) -> None:
    for text in _values(world["nan-forward"]):
        assert text.startswith("NonFiniteError: training step 1: non-finite values (NaN or Inf) first appeared "
                               "in the forward output of stage 0 (rank 0)")
        assert "stages with non-finite forward outputs: [0, 1], with non-finite gradients: [0, 1]" in text
    assert _values(world["nan-unchecked"]) == ["no error", "no error"]  # the check is opt-in


def test_non_finite_gradients_only_are_traced_to_their_stage(world) -> None:
    for text in _values(world["nan-backward"]):
        assert "first appeared in the parameter gradients of stage 1 (rank 0), in backward" in text
        assert "non-finite forward outputs: none, with non-finite gradients: [1]" in text


def test_later_failures_read_the_first_one_from_the_store(world) -> None:
    rank0, rank1 = _values(world["first-failure"])
    assert rank1 == [None]  # rank 1 failed first
    assert rank0 == ["rank 1: RuntimeError: boom on rank 1"]


def test_checkpoints_carry_digests_and_damage_is_named(world) -> None:
    out0, out1 = _values(world["checkpoint-integrity"])
    root = out0["root"]
    for out in (out0, out1):  # every rank sees the same
        assert "__0_0.distcp" in out["digested"] and "__1_0.distcp" in out["digested"] and ".metadata" in out["digested"]
        assert "rng/rank0.pt" in out["digested"] and "rng/rank1.pt" in out["digested"]
        assert out["other_jobs_tmp_kept"]  # a save removes only its own job's leftovers
        assert out["latest"] == "step_00000003"
        assert out["auto"] == "step_00000002"  # the damaged newest is skipped for the previous good one
        bad = f"{root}/step_00000003/__1_0.distcp"
        assert out["explicit"].startswith(f"CheckpointError: train.resume='{root}/step_00000003': {bad} does not "
                                          f"match its digest in {root}/step_00000003/meta.json"), out["explicit"]
        assert out["garbled"].startswith(f"CheckpointError: train.resume='{root}/step_00000002': "
                                         f"{root}/step_00000002/meta.json cannot be read (JSONDecodeError"), out["garbled"]
        assert out["garbled_skipped"] == "step_00000001"
        assert f"{root}/step_00000001/rng/rank1.pt is missing" in out["missing"] and out["missing"].startswith("CheckpointError")
        assert out["outside_ignored"] == "step_00000003" and out["outside_warned"]  # `latest` is not followed outside
        assert out["old_loads"] == "no error"  # an older checkpoint (no digests) loads, with a warning
    assert out0["auto_warned"]
    assert any("has no file digests" in line for line in out0["old_warned"])
    assert any("rng/rank1.pt is missing" in line for line in out1["old_warned"])  # rank 1 says its RNG is not restored
    for out in (out0, out1):  # torch's CheckpointException (a BaseException) becomes a named error with the path
        assert out["dcp_failure"].startswith(f"CheckpointError: loading checkpoint {root}/step_00000004: CheckpointException"), out["dcp_failure"]


def test_a_layer_failing_in_the_shape_negotiation_is_a_stage_error(world) -> None:
    for text in _values(world["trial-forward"]):
        assert text.startswith("StageError: pipeline rank 0, stage 0, shape negotiation (a trial forward on zeros "
                               "shaped like micro-batch 0: ['[4, "), text
        assert "]): ValueError: mat1 and mat2 shapes cannot be multiplied" in text, text


def test_a_dead_peer_noticed_while_posting_is_a_named_comm_error(world) -> None:
    for rank, out in enumerate(_values(world["post-failure"])):
        assert out["comm"].startswith(f"CommError: pipeline rank {rank} (global rank {rank}): batched P2P call failed "
                                      f"while trying to send a test tensor: [/pytorch"), out["comm"]
        assert "Connection closed by peer" in out["comm"]
        text = out["pipeline"]
        assert text.startswith(f"CommError: pipeline rank {rank} (global rank {rank}): batched P2P call failed while "
                               f"trying to "), text
        assert "), when posting them: " in text and "\n  this rank had " in text and "program step" in text, text


def test_a_non_finite_input_batch_is_named_on_every_rank_not_the_learning_rate(world) -> None:
    for text in _values(world["nan-input"]):
        assert text.startswith("NonFiniteError: training step 5: the input batch holds NaN or Inf: micro-batch 1 "
                               "(3 NaN and 1 Inf) of stage 0's input on global rank 0 (batch 5 of the training "
                               "data)"), text
        assert "the learning rate is not the cause" in text and "Lower optim.lr" not in text
    for text in _values(world["finite-input"]):  # finite inputs: the step's own error stands
        assert text == "NonFiniteError: training step 5: the loss ... hold NaN or Inf ... Lower optim.lr"


def test_a_dp_peer_that_stops_answering_is_a_named_comm_error(world) -> None:
    text, other = _values(world["dp-peer-stops"])
    assert other == "took no part"
    assert text.startswith("CommError: rank 0: the data-parallel gradient all-reduce of stage 3 (bucket 1 of this "
                           "step, 0.00 MiB) over global ranks [0, 1] failed: no answer within the group's timeout: "
                           "a peer in it stopped (SIGSTOP)"), text
    assert "The backend said: " in text and text.endswith("| cause: RuntimeError"), text


def test_a_lost_tp_peer_is_a_comm_error_naming_the_tp_group_not_the_layer(world) -> None:
    """Issue 38: a killed tensor-parallel peer was a layer's ``StageError ...: RuntimeError: gloo
    Read error`` naming neither the tp group nor a lost peer."""
    text, other = _values(world["tp-peer-lost"])
    assert other == "stopped"
    assert text.startswith("CommError: rank 0: the tensor-parallel collective at pipeline rank 0, stage "), text
    assert ("(this rank's layers are split over its tp group) over global ranks [0, 1] failed: no answer within the "
            "group's timeout") in text, text
    assert "The backend said: " in text and text.endswith("| cause: RuntimeError"), text


def test_a_lost_ep_peer_is_a_comm_error_naming_the_ep_group_not_the_layer(world) -> None:
    """Issue 57: a killed expert-parallel peer was ``StageError ... action 2B3: RuntimeError: [gloo]
    Connection closed by peer``, blaming the layer; tp named its group, ep did not."""
    text, other = _values(world["ep-peer-lost"])
    assert other == "stopped"
    assert text.startswith("CommError: rank 0: the expert-parallel all_to_all at pipeline rank 0, stage "), text
    assert ("(this rank's MoE experts are split over its ep group) over global ranks [0, 1] failed: no answer "
            "within the group's timeout") in text, text


def test_a_backend_failure_in_a_training_step_names_the_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective of the step (here train.check_finite's flags all-reduce) failing with gloo's
    raw error inside the step's context is a CommError naming that collective, the code that
    called it and the step; a plain RuntimeError is left alone."""
    from pipeflow.errors import CommError
    from pipeflow.runtime.finite import FiniteCheck

    def closed(*args, **kwargs):
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                           "[127.0.0.1]:4242. This is typically caused by a remote worker crashing.")

    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    check = FiniteCheck({}, 2, torch.device("cpu"))
    with pytest.raises(CommError) as caught, failures.context("training step 7"):
        check.check(7, [0, 1])
    text = str(caught.value)
    assert re.match(r"rank 0: the all-reduce of train.check_finite's flags, a collective in FiniteCheck.check "
                    r"\(pipeflow/runtime/finite.py:\d+\) failed: a peer in it died or left \(its connection closed\)",
                    text), text
    assert "Connection closed by peer" in text and text.endswith("\n  during training step 7")
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="^mat1 and mat2"), failures.context("training step 7"):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_a_raw_backend_failure_reaching_fail_is_logged_as_a_named_comm_error() -> None:
    from pipeflow.errors import CommError, StageError

    raw = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 18000ms "
                       "for recv operation to complete")
    named = guard.named_failure(raw)
    assert isinstance(named, CommError) and named.__cause__ is raw
    assert "failed: no answer within the group's timeout" in str(named) and "Timed out waiting 18000ms" in str(named)
    already = StageError("pipeline rank 0, stage 0 ...")
    assert guard.named_failure(already) is already and guard.named_failure(KeyError("x")).__class__ is KeyError


def test_peers_are_named_by_pipeline_and_global_rank(world) -> None:
    rank0, rank1 = _values(world["global-rank-named"])
    assert "pipeline rank 0 is global rank" not in rank0  # the same numbers: said once
    assert rank1.endswith("; pipeline rank 0 is global rank 1)"), rank1


def test_ranks_agree_to_skip_a_sweep_job_that_failed_on_one_of_them(world) -> None:
    """All ranks must walk a sweep (tests/test_sweep.py) together: one rank's build error makes every rank skip."""
    assert _values(world["sweep-one-fails"]) == [(None, "ConfigError: pipeline.num_microbatches=3 is odd on rank 1")] * 2
    assert _values(world["sweep-none-fails"]) == [("built on 0", ""), ("built on 1", "")]


# ------------------------------------------------------------------------ torchrun with faults
FAST = ["model=mlp", "data=gaussian", "train.max_steps=6", "train.eval_every=0", "train.eval_batches=1",
        "pipeline.profile=false", "comm.timeout_s=3", "comm.first_step_timeout_s=30"]
INJECTED = re.compile(r"\[pipeflow fault injection\] rank (\d+): (\w+) at training step (\d+).*t=([\d.]+)")


class Job:
    """A finished job: exit code, output, seconds from the injected fault to the exit, and the
    processes left behind: under torchrun (`monitor_interval_s` given) those whose command line names the
    run directory; on warm forks (tests/warm.py) the ranks that had not left by themselves within
    WARM_LEAVE_S of the first failure and had to be ended."""

    def __init__(self, proc: subprocess.CompletedProcess, ended: float, marker: str) -> None:
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr
        match = INJECTED.search(self.output)
        self.detect_s = ended - float(match.group(4)) if match else None
        terminated = getattr(proc, "terminated", None)
        self.survivors = terminated if terminated is not None else _survivors(marker, ended + SURVIVOR_GRACE_S)


SURVIVOR_GRACE_S = 0.5  # a job's processes may take this long after torchrun returns to be gone
WARM_LEAVE_S = 20.0  # on warm forks, every rank must leave by itself within this long of the first failure


def _survivors(marker: str, deadline: float) -> list[int]:
    """The job's processes still alive at `deadline` (looked for until then: most jobs leave none at once)."""
    while True:
        alive = [pid for pid in _pids_with(marker) if pid != os.getpid()]
        if not alive or time.time() >= deadline:
            return alive
        time.sleep(0.05)


def _pids_with(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (the job's unique run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run_job(nproc: int, tmp_path: Path, *overrides: str, fault: str | None = None,
            per_rank: dict[int, str] | None = None, monitor_interval_s: float | None = None) -> Job:
    """train.py on `nproc` ranks with `fault` in PIPEFLOW_FAULT_INJECT; `per_rank` adds an override
    on one rank.  The ranks are warm forks (tests/warm.py) that must all leave by themselves;
    `monitor_interval_s` launches real torchrun instead, its agent looking at its workers that
    often (for what only torchrun's agent reports: a worker's signal)."""
    args = [*FAST, *overrides, f"train.run_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PIPEFLOW_FAULT_INJECT", None)
    if fault:
        env["PIPEFLOW_FAULT_INJECT"] = fault
    if monitor_interval_s is None:
        proc = warm.launch(["train.py", *args], nproc, cwd=ROOT, env=env, timeout=180,
                           per_rank={r: [o] for r, o in (per_rank or {}).items()}, peers_ended_after_s=WARM_LEAVE_S)
        return Job(proc, time.time(), str(tmp_path))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
              "--monitor-interval", str(monitor_interval_s), "train.py", *args]
    proc = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=180, env={**env, **interpreters()})
    return Job(proc, time.time(), str(tmp_path))


def _report(job: Job) -> str:
    return f"rc={job.returncode} detect={job.detect_s}\n{job.output[-4000:]}"


def test_a_rank_stalled_in_forward_makes_its_peer_time_out_and_the_job_exit(tmp_path: Path) -> None:
    job = run_job(2, tmp_path, fault="stall:rank=1:step=2")
    assert job.returncode != 0, _report(job)
    assert "rank 0 failed with PipelineTimeoutError" in job.output
    assert "PipelineTimeoutError: pipeline rank 0 (global rank 0): no progress within 3.0 s" in job.output
    assert "recv gradient of micro-batch 0 from stage 1 (rank 1)" in job.output
    assert "this rank had completed 2 of 16 program steps of this pass; last actions: 0F0, 0F1" in job.output
    assert "during training step 2" in job.output
    assert job.detect_s is not None and job.detect_s < 3 + 10, _report(job)
    assert not job.survivors


def test_an_exception_in_a_layer_on_rank_2_of_4_stops_every_rank(tmp_path: Path) -> None:
    job = run_job(4, tmp_path, fault="raise:rank=2:step=1:microbatch=3")
    assert job.returncode != 0, _report(job)
    assert "rank 2 failed with StageError" in job.output, _report(job)
    assert ("StageError: pipeline rank 2, stage 2, micro-batch 3, action 2F3: "
            "RuntimeError: injected failure in a layer") in job.output
    assert "during training step 1" in job.output
    assert re.search(r"the first failure in this job was rank 2: StageError", job.output), _report(job)
    assert job.detect_s is not None and job.detect_s < 10, _report(job)
    assert not job.survivors


def test_a_killed_rank_is_noticed_and_the_job_exits(tmp_path: Path) -> None:
    # torchrun's agent SIGTERMs the survivors as soon as it sees a worker die (it looks every 0.1 s);
    # on two busy cores that could beat rank 0's own detection, which is what this test is about
    # (CI once saw exactly that). Looking every 2 s leaves rank 0 to notice the dead peer itself.
    job = run_job(2, tmp_path, fault="kill:rank=1:step=2", monitor_interval_s=2.0)
    assert job.returncode != 0, _report(job)
    assert "rank 0 failed with CommError" in job.output
    assert "CommError: pipeline rank 0 (global rank 0): batched P2P call failed" in job.output
    assert "stage 1 (rank 1)" in job.output and "during training step 2" in job.output
    assert re.search(r"exitcode\s*: -9", job.output), _report(job)  # torchrun: the root cause
    assert job.detect_s is not None and job.detect_s < 3 + 10, _report(job)
    assert not job.survivors


def test_a_wrong_shape_mid_run_is_named_and_the_job_exits(tmp_path: Path) -> None:
    job = run_job(2, tmp_path, fault="shape:rank=0:step=2")
    assert job.returncode != 0, _report(job)
    assert "ShapeMismatchError: stage 0 (rank 0) produced outputs ['[4, 64] float32, grad'] for micro-batch 0" in job.output
    assert "stage 1 (rank 1) expects ['[8, 64] float32, grad']" in job.output
    assert "comm.shapes=per_step" in job.output
    assert job.detect_s is not None and job.detect_s < 10, _report(job)
    assert not job.survivors


def test_ranks_launched_with_different_overrides_stop_at_start(tmp_path: Path) -> None:
    job = run_job(2, tmp_path, per_rank={1: "pipeline.num_microbatches=4"})
    assert job.returncode != 0, _report(job)
    assert "ConfigMismatchError: the ranks were started with different configs" in job.output
    assert "pipeline.num_microbatches: 8 on rank 0; 4 on rank 1" in job.output, _report(job)
    assert not job.survivors


def test_a_deadlocking_schedule_file_stops_every_rank_with_the_grid(tmp_path: Path) -> None:
    bad = tmp_path / "swapped.txt"
    bad.write_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1\n")  # rank 0 waits for 1B0 before sending 0F1
    started = time.time()
    job = run_job(2, tmp_path, "schedule=custom", f"schedule.path={bad}", "pipeline.num_microbatches=2")
    assert job.returncode != 0, _report(job)
    for rank in (0, 1):
        assert f"rank {rank} failed: DeadlockError: {bad}" in job.output, _report(job)
    assert "[1F1]" in job.output and "rank 0" in job.output
    assert "warm-up" not in job.output and "run directory" not in job.output  # nothing ran
    assert time.time() - started < 60
    assert not job.survivors


def test_check_finite_stops_every_rank_at_the_stage_that_made_nan(tmp_path: Path) -> None:
    job = run_job(2, tmp_path, "train.check_finite=true", fault="nan:rank=0:step=2")
    assert job.returncode != 0, _report(job)
    for rank in (0, 1):  # one line each, as the message says all (issue 57: a traceback of ~20 lines)
        assert f"rank {rank} failed: NonFiniteError: training step 2: " in job.output, _report(job)
    assert ("NonFiniteError: training step 2: non-finite values (NaN or Inf) first appeared in the forward "
            "output of stage 0 (rank 0)") in job.output
    assert "Traceback" not in job.output, _report(job)
    assert job.detect_s is not None and job.detect_s < 10, _report(job)
    assert not job.survivors
