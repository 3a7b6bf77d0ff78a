"""Cases run inside every rank of a gloo group (see mp_harness): agreement checks, stage faults.

The stage-fault cases run a two-stage pipeline inside each rank's own one-rank group, so the
faults stay local and the shared group stays usable for the cases after them.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from pipeflow.run import guard
from pipeflow.runtime.transport import P2PComm
from pipeflow.config.schema import Config, MLPModelConfig
from pipeflow.run.faults import FaultInjector, FaultSpec
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.planning.partition import partition_layers
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.schedules import build_schedule, lower
from pipeflow.runtime.stage import build_stages
from toy_models import build_toy, random_batch

BATCH = 8


def _error(call: Any) -> str:
    """``Type: message`` of what `call()` raised (``no error`` if nothing)."""
    try:
        call()
    except Exception as exc:  # the tests assert on the text
        cause = f" | cause: {type(exc.__cause__).__name__}" if exc.__cause__ is not None else ""
        return f"{type(exc).__name__}: {exc}{cause}"
    return "no error"


def config_agreement(differ: bool) -> str:
    """check_same_config on a structured config; with `differ`, rank 1 has other overrides."""
    cfg = OmegaConf.structured(Config(model=MLPModelConfig()))
    cfg.train.run_dir = f"outputs/rank{dist.get_rank()}"  # may differ: rank 0's is broadcast
    if differ and dist.get_rank() == 1:
        cfg.pipeline.num_microbatches = 4
        cfg.comm.timeout_s = 60.0
    return _error(lambda: guard.check_same_config(cfg)) if differ else guard.check_same_config(cfg)


def program_agreement() -> str:
    """check_same_program when rank 1 built its schedule for another micro-batch count."""
    p = dist.get_world_size()
    schedule = build_schedule("1f1b", p, 4 if dist.get_rank() == 0 else 8)
    return _error(lambda: guard.check_same_program(schedule, partition_layers(2 * p, p)))


@functools.lru_cache(maxsize=1)
def _own_group() -> Any:
    """A one-rank group per rank (every rank creates every group, as new_group requires)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def stage_fault(kind: str, microbatch: int = 1, check_finite: bool = False, nan_grad_stage: int | None = None) -> str:
    """A two-stage pipeline on this rank alone (interleaved 1F1B, p = 1); `kind` injected into
    stage 0's forward of `microbatch` at step 1 (step 0 runs clean and negotiates shapes).
    With `check_finite`, a FiniteCheck runs after each step; `nan_grad_stage` turns that
    stage's first parameter gradient into NaN from step 1 on (a backward-only fault)."""
    group = _own_group()
    spec = build_toy("mlp")
    schedule = build_schedule("interleaved_1f1b", 1, 2, stages_per_rank=2)
    ranges = partition_layers(len(spec.layers), 2)
    stages = build_stages(spec, ranges, [0, 1], dtype=torch.float64)
    pipe = Pipeline(stages, schedule, P2PComm(group, torch.device("cpu"), timeout_s=10.0))
    injector = FaultInjector(FaultSpec(kind, rank=dist.get_rank(), step=1, microbatch=microbatch, stage=0), dist.get_rank())
    injector.install(stages)
    finite = FiniteCheck(stages, 2, torch.device("cpu")) if check_finite else None
    if nan_grad_stage is not None:
        weight = stages[nan_grad_stage].parameters()[0]
        weight.register_hook(lambda g: g * float("nan") if injector.step == 1 else g)

    def run() -> None:
        for step in range(2):
            injector.step = step
            x, y = random_batch("mlp", BATCH, seed=step)
            pipe.run([(mb,) for mb in x.chunk(2)], list(y.chunk(2)))
            if finite is not None:
                finite.check(step, schedule.stage_to_rank, group)

    return _error(run)


def first_failure_is_shared() -> list[str | None]:
    """Rank 1 records a failure first, then rank 0: rank 0 reads rank 1's back from the store."""
    rank = dist.get_rank()
    seen: list[str | None] = []
    for turn in (1, 0):
        if rank == turn:
            seen.append(guard.record_failure(RuntimeError(f"boom on rank {rank}"), rank))
        dist.barrier()
    return seen


# ------------------------------------------------------------------------------- checkpoints
def _shared_dir() -> str:
    """A fresh directory made by rank 0, its path on every rank."""
    box = [tempfile.mkdtemp(prefix="pf-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Logged(logging.Handler):
    """Collects the pipeflow logger's messages while a case runs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _on_rank0(action: Any) -> None:
    """Run `action` on rank 0 alone, once every rank is done with what came before (a rank still
    reading a folder must not see it removed) and before any rank goes on."""
    dist.barrier()
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _flip_a_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def checkpoint_integrity() -> dict[str, Any]:
    """Digests at save and load: a flipped bit, a garbled meta.json, a missing file, ``latest``
    pointing outside its folder, an older checkpoint without digests, another job's leftover.
    Rank r holds layer r (a Linear) with AdamW state.  Returns what every rank saw."""
    from pipeflow.checkpoint import saving as ck, integrity

    rank, root = dist.get_rank(), _shared_dir()
    torch.manual_seed(rank)
    layers = {rank: torch.nn.Linear(4, 4)}
    opt = torch.optim.AdamW(layers[rank].parameters(), lr=0.1)
    layers[rank](torch.ones(2, 4)).sum().backward()
    opt.step()
    logged = _Logged()
    logging.getLogger("pipeflow").addHandler(logged)
    out: dict[str, Any] = {}
    try:
        steps = {k: ck.save(root, k, layers, opt, {"scaler": {}}, job="jobA") for k in (1, 2)}
        out["digested"] = sorted(ck.read_meta(steps[2])["files"])
        other = os.path.join(root, "step_00000009.jobB.tmp")
        _on_rank0(lambda: os.makedirs(other))
        steps[3] = ck.save(root, 3, layers, opt, {"scaler": {}}, job="jobA")
        out["other_jobs_tmp_kept"] = os.path.isdir(other)
        out["latest"] = os.path.basename(ck.find_latest(root))
        damaged = os.path.join(steps[3], "__1_0.distcp")
        _on_rank0(lambda: _flip_a_byte(damaged))
        out["auto"] = os.path.basename(ck.choose("auto", root))
        out["auto_warned"] = any(f"skipping damaged checkpoint {steps[3]}" in line and damaged in line for line in logged.lines)
        out["explicit"] = _error(lambda: ck.choose(steps[3], root))
        _on_rank0(lambda: open(os.path.join(steps[2], "meta.json"), "w").write("{not json"))
        out["garbled"] = _error(lambda: ck.choose(steps[2], root))
        out["garbled_skipped"] = os.path.basename(ck.choose("auto", root))  # 3 and 2 damaged: step 1
        rng = os.path.join(steps[1], "rng", "rank1.pt")
        _on_rank0(lambda: os.remove(rng))
        out["missing"] = _error(lambda: ck.choose(steps[1], root))
        _on_rank0(lambda: open(os.path.join(root, "latest"), "w").write("../elsewhere/step_00000001"))
        out["outside_ignored"] = os.path.basename(ck.find_latest(root))
        out["outside_warned"] = any("is not inside" in line for line in logged.lines)
        # an older checkpoint: no digests; its rank-1 RNG file is gone too; its data file as well
        old = ck.save(root, 4, layers, opt, {"scaler": {}}, job="jobA")

        def strip() -> None:
            meta = ck.read_meta(old)
            del meta["files"]
            open(os.path.join(old, "meta.json"), "w").write(json.dumps(meta))
            os.remove(os.path.join(old, "rng", "rank1.pt"))

        _on_rank0(strip)
        integrity._warned_no_digests = False
        out["old_loads"] = _error(lambda: ck.load(ck.choose(old, root), layers, opt))
        out["old_warned"] = [line for line in logged.lines if "no file digests" in line or "rank1.pt is missing" in line]
        _on_rank0(lambda: os.remove(os.path.join(old, "__0_0.distcp")))
        out["dcp_failure"] = _error(lambda: ck.load(old, layers, opt))
    finally:
        logging.getLogger("pipeflow").removeHandler(logged)
        _on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    out["root"] = root
    return out


def trial_forward_fault() -> str:
    """A user's layer that raises on the shapes of the first batch: a StageError from the
    shape negotiation (this rank's own two-stage pipeline)."""
    spec = build_toy("mlp")
    schedule = build_schedule("interleaved_1f1b", 1, 2, stages_per_rank=2)
    ranges = partition_layers(len(spec.layers), 2)
    stages = build_stages(spec, ranges, [0, 1], dtype=torch.float64)
    pipe = Pipeline(stages, schedule, P2PComm(_own_group(), torch.device("cpu"), timeout_s=10.0))

    def broken(*args: Any) -> Any:
        raise ValueError("mat1 and mat2 shapes cannot be multiplied (4x16 and 8x16)")

    stages[0].module[0].forward = broken
    x, y = random_batch("mlp", BATCH, seed=0)
    return _error(lambda: pipe.run([(mb,) for mb in x.chunk(2)], list(y.chunk(2))))


def post_failure() -> dict[str, str]:
    """A backend failure while posting (a peer already gone) is a named CommError, from the
    transport and from the interpreter (with this rank's progress); both ranks fail alike."""
    from pipeflow.runtime import transport

    p = dist.get_world_size()
    spec = build_toy("mlp")
    schedule = build_schedule("1f1b", p, 2)
    stages = build_stages(spec, partition_layers(len(spec.layers), p), [dist.get_rank()], dtype=torch.float64)
    comm = P2PComm(None, torch.device("cpu"), timeout_s=20.0)
    pipe = Pipeline(stages, schedule, comm)
    x, y = random_batch("mlp", BATCH, seed=0)
    inputs = [(mb,) for mb in x.chunk(2)] if 0 in stages else None
    targets = list(y.chunk(2)) if p - 1 in stages else None
    pipe.run(inputs, targets)  # step 0 clean: shapes negotiated
    real = transport.dist.batch_isend_irecv

    def closed(ops: Any) -> Any:
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")

    transport.dist.batch_isend_irecv = closed
    try:
        out = {"comm": _error(lambda: comm.post([(1 - dist.get_rank(), torch.zeros(1))], [], what="send a test tensor")),
               "pipeline": _error(lambda: pipe.run(inputs, targets))}
    finally:
        transport.dist.batch_isend_irecv = real
    dist.barrier()
    return out


def peers_named_by_global_rank() -> str:
    """On global rank 1, inside a one-rank group, pipeline rank 0 is global rank 1: a transfer's
    description names both."""
    spec = build_toy("mlp")
    schedule = build_schedule("interleaved_1f1b", 1, 2, stages_per_rank=2)
    stages = build_stages(spec, partition_layers(len(spec.layers), 2), [0, 1], dtype=torch.float64)
    pipe = Pipeline(stages, schedule, P2PComm(_own_group(), torch.device("cpu"), timeout_s=10.0))
    program = build_schedule("1f1b", 2, 2)
    step = next(st for st in lower(program)[1] if st.ops)
    return pipe._describe(0, step, step.ops, False)


# ------------------------------------------------------------------ issue 28 item 9: named errors
def nan_input_blamed(nan: bool) -> str:
    """Step 5 failed non-finite on every rank; global rank 0 holds stage 0, whose micro-batch 1
    holds 3 NaN and an Inf when `nan`: every rank's error names that input, not optim.lr."""
    from pipeflow.errors import NonFiniteError
    from pipeflow.runtime.finite import inputs_blamed

    inputs = None
    if dist.get_rank() == 0:
        inputs = [(torch.ones(4, 8),), (torch.ones(4, 8),)]
        if nan:
            inputs[1][0][0, :3] = float("nan")
            inputs[1][0][2, 5] = float("inf")

    def step() -> None:
        with inputs_blamed(5, lambda: inputs, 2, torch.device("cpu")):
            raise NonFiniteError("training step 5: the loss ... hold NaN or Inf ... Lower optim.lr")

    return _error(step)


class _OneLayer:
    """A stage with one weight and its gradient (what GradReducer reads)."""

    def __init__(self) -> None:
        self.weight = torch.nn.Parameter(torch.ones(4, 4))
        self.weight.grad = torch.ones(4, 4)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight]


def dp_peer_stops_answering() -> str:
    """The data-parallel gradient all-reduce over a 2-rank group (timeout 2 s) in which rank 1
    never takes part (stopped): rank 0's error names the collective, the stage, the group's
    ranks and a peer that stopped answering (not gloo's raw 'Timed out waiting')."""
    import datetime

    from pipeflow.runtime.parallel.mesh import GradReducer

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() != 0:
        return "took no part"
    reducer = GradReducer({3: _OneLayer()}, group, 2)
    return _error(reducer.finish)


class _SplitBlock(torch.nn.Module):
    """fc1 split by columns, fc2 by rows over the tp ranks: fc2's output is all-reduced over them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def tp_peer_lost() -> str:
    """A tp group of both ranks splits stage 0 of each rank's own two-stage pipeline; after a clean
    step rank 1 stops taking part (a lost peer, as a cut-off host is: no reset) and rank 0's next
    step meets gloo's raw timeout inside a layer (its tp group's deadline lowered to 1 s): it must
    name the tensor-parallel collective and the tp group, not blame the layer."""
    import datetime

    from torch.distributed.device_mesh import DeviceMesh

    from pipeflow.models.spec import LayerSpec, ModelSpec
    from pipeflow.runtime.parallel.tensor_parallel import parallelize_stages

    tp = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    spec = ModelSpec("split", [LayerSpec("block", _SplitBlock, ()), LayerSpec("head", torch.nn.Linear, (8, 4))],
                     loss_fn=lambda o, t: ((o - t) ** 2).mean(), tp_plan={"fc1": "colwise", "fc2": "rowwise"})
    ranges = partition_layers(2, 2)
    stages = build_stages(spec, ranges, [0, 1], dtype=torch.float64)
    parallelize_stages(spec, {0: stages[0]}, ranges, DeviceMesh.from_group(tp, "cpu", mesh_dim_names=("tp",)), False)
    schedule = build_schedule("interleaved_1f1b", 1, 2, stages_per_rank=2)
    pipe = Pipeline(stages, schedule, P2PComm(_own_group(), torch.device("cpu"), timeout_s=10.0))
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    return _step_then_rank_1_stops(pipe, tp, x, y)


class _ExpertBlock(torch.nn.Module):
    """Two routed experts (top 1) on a residual stream of width 8, (B, T, 8) -> (B, T, 8)."""

    def __init__(self) -> None:
        super().__init__()
        from pipeflow.models.moe import MoE, MoEConfig

        self.moe = MoE(8, MoEConfig(experts=2, top_k=1, aux_loss_coef=0.0), bias=False, dropout=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)


def ep_peer_lost() -> str:
    """An ep group of both ranks splits the experts of stage 0 of each rank's own two-stage
    pipeline; after a clean step rank 1 stops taking part and rank 0's next step meets gloo's raw
    timeout inside the experts' all_to_all (the group's deadline lowered to 1 s): it must name the
    expert-parallel exchange and the ep group, not blame the layer (issue 57, item 9)."""
    import datetime

    from pipeflow.models.spec import LayerSpec, ModelSpec
    from pipeflow.runtime.parallel.expert_parallel import split_experts

    ep = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    spec = ModelSpec("experts", [LayerSpec("block", _ExpertBlock, ()), LayerSpec("head", torch.nn.Linear, (8, 4))],
                     loss_fn=lambda o, t: ((o - t) ** 2).mean())
    torch.manual_seed(0)  # the same router on both ranks
    stages = build_stages(spec, partition_layers(2, 2), [0, 1], dtype=torch.float64)
    assert split_experts([stages[0].module], ep, 2) == 1
    schedule = build_schedule("interleaved_1f1b", 1, 2, stages_per_rank=2)
    pipe = Pipeline(stages, schedule, P2PComm(_own_group(), torch.device("cpu"), timeout_s=10.0))
    x, y = torch.randn(4, 3, 8, dtype=torch.float64), torch.randn(4, 3, 4, dtype=torch.float64)
    return _step_then_rank_1_stops(pipe, ep, x, y)


def _step_then_rank_1_stops(pipe: Pipeline, group: Any, x: torch.Tensor, y: torch.Tensor) -> str:
    """A step both ranks of `group` take part in; then rank 1 stops and rank 0 steps again with
    the group's deadline lowered to 1 s: rank 0's error text."""
    from pipeflow.runtime.world.timeouts import set_group_timeout

    pipe.run([(mb,) for mb in x.chunk(2)], list(y.chunk(2)))
    dist.barrier()
    if dist.get_rank() == 1:
        return "stopped"
    set_group_timeout(group, 1.0)
    return _error(lambda: pipe.run([(mb,) for mb in x.chunk(2)], list(y.chunk(2))))


def _layer_with_nan_weights() -> torch.nn.Module:
    """A layer whose loading fails as NaN in a weights file does (model=hf, model.init_from)."""
    from pipeflow.errors import CheckpointError

    raise CheckpointError("layer 'head': tensor 'lm_head.weight' in /models/x/model.safetensors holds 1 NaN and 0 Inf")


def weights_error_in_the_profile() -> str:
    """Rank 0 profiles every layer, so it alone builds (and loads) layer 'head', which fails: every
    rank must raise that error, not rank 0 alone with rank 1 left in the profiles' broadcast."""
    from pipeflow.models.spec import LayerSpec, ModelSpec
    from pipeflow.planning.layout import choose_layout

    spec = ModelSpec("damaged", [LayerSpec("body", torch.nn.Linear, (4, 4)), LayerSpec("head", _layer_with_nan_weights)],
                     loss_fn=lambda o, t: ((o - t) ** 2).mean())
    pipeline = OmegaConf.create({"balance": "uniform", "split_points": None, "profile": True})
    schedule = build_schedule("1f1b", 2, 2)
    return _error(lambda: choose_layout(spec, schedule, pipeline, torch.zeros(2, 4), torch.device("cpu"), torch.float32))


def weights_error_in_one_ranks_build() -> str:
    """pipeline.profile=false: only rank 1 builds layer 'head', whose weights hold NaN; the build
    is agreed over the world (one all-gather), so rank 0 raises rank 1's error too."""
    from pipeflow.run.builder import built_on_every_rank

    def build() -> dict:
        if dist.get_rank() == 1:
            _layer_with_nan_weights()
        return {0: "stage 0"}

    return _error(lambda: built_on_every_rank(build))


# ------------------------------------------------------------------ sweeps (tests/test_sweep.py's jobs)
def sweep_build_fails_on_rank_1() -> tuple:
    """A sweep job whose build raises a ConfigError on rank 1 but succeeds on rank 0."""
    from pipeflow.errors import ConfigError
    from pipeflow.commands.sweep import _build_agreed

    def build() -> str:
        if dist.get_rank() == 1:
            raise ConfigError("pipeline.num_microbatches=3 is odd on rank 1\nsecond line")
        return "built"

    return _build_agreed(build)


def sweep_build_everywhere() -> tuple:
    """A sweep job that builds on every rank."""
    from pipeflow.commands.sweep import _build_agreed

    return _build_agreed(lambda: f"built on {dist.get_rank()}")
