"""Cases run inside every rank of a gloo group (see mp_harness): the Trainer on a dp x pp mesh
against the unsplit model on the global batch, mixed precision, activation checkpointing.

Each case builds a real Trainer from a config (the code path of ``train.py``) and, in the same
process, the unsplit reference model trained on the same global batches with the same lr
schedule, clipping and AdamW.
"""
from __future__ import annotations

import copy
import functools
import gc
import math
import os
import tempfile
import weakref
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from pipeflow.config.schema import DATA_SCHEMAS, Config, GPTModelConfig, MarkovDataConfig
from pipeflow.models.spec import run_layers
from pipeflow.runtime.tied import tie_in_place
from pipeflow.runtime.parallel.zero import local_optimizer, owned_parameters
from pipeflow.data import build_batches
from pipeflow.run.builder import RECVS_AHEAD, build_run
from pipeflow.run.trainer import Trainer, lr_at, unique_parameters

BATCH = 24
TMP_ENV = "PIPEFLOW_TEST_TMP"  # where run directories go (the test's tmp dir; inherited by the workers)


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (a sharded `actual` gathered whole first: collective
    over its dp group, called by every replica alike)."""
    if isinstance(actual, DTensor):  # a fused [q; k; v] tp split gathered in its own order
        from pipeflow.runtime.parallel.tensor_parallel import gathered

        actual = gathered(actual)
    scale = expected.abs().max().item()
    err = (actual.to(expected.dtype) - expected).abs().max().item()
    return err / scale if scale > 0 else err


def make_config(dp: int, schedule: str = "1f1b", m: int = 2, **train: Any) -> Any:
    """A small tied GPT on Markov data, float64, no profiling; `train` overrides any section
    as ``section__key=value`` (e.g. ``optim__grad_clip=0.05``); ``data__name`` picks the data
    source's schema (its keys)."""
    cfg = copy.deepcopy(_base_config(train.pop("data__name", "markov")))
    cfg.schedule.name = schedule
    cfg.pipeline.num_microbatches = m
    cfg.pipeline.profile = False
    cfg.optim.update(lr=1e-2, warmup_steps=2, grad_clip=0.0)
    cfg.train.update(param_dtype="float64", max_steps=3, eval_every=0, eval_batches=1, log_every=100)
    cfg.parallel.dp = dp
    for key, value in train.items():
        section, _, name = key.partition("__")
        OmegaConf.update(cfg, f"{section}.{name}", value)
    if cfg.train.run_dir is None:
        cfg.train.run_dir = _shared_dir("pipeflow-scale-")
    return cfg


@functools.lru_cache(maxsize=None)
def _base_config(data_name: str) -> Any:
    """The small tied GPT's config on `data_name` (made once per process: a typed config costs
    milliseconds a copy does not)."""
    data = DATA_SCHEMAS[data_name](seq_len=8, batch_size=BATCH)
    if isinstance(data, MarkovDataConfig):
        data.vocab_size, data.num_tokens = 32, 4000
    return OmegaConf.structured(Config(model=GPTModelConfig(
        vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_embeddings=True), data=data))


class Reference:
    """The unsplit model trained as the Trainer would train one process on the whole batch."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.spec = instantiate(cfg.model)
        self.layers = self.spec.build_all(dtype=getattr(torch, cfg.train.param_dtype))
        tie_in_place(self.spec, dict(enumerate(self.layers)))
        self.params = unique_parameters(layer.parameters() for layer in self.layers)
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        self.batches = build_batches(cfg.data, cfg.model, chunks=cfg.parallel.dp * cfg.pipeline.num_microbatches)

    def grads(self, step: int) -> float:
        """Loss and (clipped) grads of batch `step`; returns the loss.  A batch given as
        micro-batches of different shapes (data.variable_lengths) counts every token alike: the
        mean of its micro-batches' mean losses, each weighted by its share of the tokens."""
        x, y = self.batches.train.get(step)
        if isinstance(x, list):
            total = sum(t.numel() for t in y)
            loss = sum(t.numel() / total * self.spec.loss_fn(run_layers(self.layers, a), t) for a, t in zip(x, y))
        else:
            loss = self.spec.loss_fn(run_layers(self.layers, x), y)
        loss.backward()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        return float(loss.detach())

    def step(self, step: int) -> None:
        """The optimizer step with the lr schedule's value for `step`."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        self.opt.step()
        self.opt.zero_grad()


def pairs(trainer: Trainer, reference: Reference) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(pipelined parameter, the same parameter of the unsplit model) for this rank's layers."""
    return [
        (mine, ref)
        for s, stage in trainer.parts.stages.items()
        for layer, idx in zip(stage.module, trainer.ranges[s])
        for mine, ref in zip(layer.parameters(), reference.layers[idx].parameters())
    ]


def dp_equivalence(dp: int, schedule: str = "1f1b", m: int = 2, steps: int = 3, **overrides: Any) -> dict[str, float]:
    """Train `steps` steps on the dp x pp mesh and unsplit; worst relative differences of loss,
    every gradient (after dp reduction and clipping) and every parameter."""
    cfg = make_config(dp, schedule, m, **overrides)
    trainer, reference = build_run(cfg, torch.device("cpu")), Reference(cfg)
    assert trainer.loop.pipeline.posting.recvs_ahead == RECVS_AHEAD[cfg.comm.post_recvs]
    both = [(a, b) for a, b in pairs(trainer, reference) if b.requires_grad]  # model.lora: the adapters
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "params_compared": len(both), "norm": 0.0,
             "shapes": trainer.loop.pipeline.shapes.mode, "params": len(trainer.parts.params),
             "owned": len(owned_parameters(trainer.loop.update.optimizer)),
             "fused": bool(local_optimizer(trainer.loop.update.optimizer).defaults.get("fused")),
             "rehearsed": getattr(trainer.plan.layout.step_costs, "rehearsed", None) is not None, "lengths": set()}
    for step in range(steps):
        for group in trainer.loop.update.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, cfg.train.max_steps)
        loss, norm = trainer.forward_backward(step)
        ref_loss = reference.grads(step)
        worst["norm"] = max(worst["norm"], norm)
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss) / abs(ref_loss))
        worst["grad"] = max([worst["grad"]] + [rel_diff(a.grad, b.grad) for a, b in both])
        trainer.loop.update.optimizer.step()
        trainer.loop.update.optimizer.zero_grad(set_to_none=True)
        reference.step(step)
        worst["param"] = max([worst["param"]] + [rel_diff(a.detach(), b.detach()) for a, b in both])
        x, _ = reference.batches.train.get(step)
        worst["lengths"].update(a.shape[1] for a in x) if isinstance(x, list) else worst["lengths"].add(x.shape[1])
    worst["compile"] = None if trainer.parts.compiled is None else trainer.parts.compiled.summary()  # train.compile
    moved = trainer.loop.pipeline.offloaded  # pipeline.offload: the last step's copies, and the groups planned here
    program = next(iter(trainer.loop.pipeline.programs.values()))
    worst["offloaded"] = None if moved is None else {"bytes": moved.bytes, "groups": moved.groups,
                                                    "planned": sum(len(step.offload) for step in program)}
    return worst


def deferred_equivalence(dp: int, schedule: str = "1f1b", m: int = 2, steps: int = 4, **overrides: Any) -> dict[str, Any]:
    """Train `steps` steps as ``Trainer.fit`` does (fused AdamW: each step's figures read back a
    step late, the update skipped on the device when not finite) against the unsplit model; worst
    relative differences of every loss and of the final parameters, and whether it deferred."""
    cfg = make_config(dp, schedule, m, optim__fused=True, optim__grad_clip=0.05, **overrides)
    trainer, reference = build_run(cfg, torch.device("cpu")), Reference(cfg)
    both = pairs(trainer, reference)
    losses, previous = [], None
    for step in range(steps):
        previous, done = trainer.advance(step, previous)
        losses += [values.loss for _, values in done]
    losses.append(trainer.finish(previous).loss)
    ref_losses = []
    for step in range(steps):
        ref_losses.append(reference.grads(step))
        reference.step(step)
    return {"deferred": trainer.defers_readback,
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param": max(rel_diff(a.detach(), b.detach()) for a, b in both)}


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))


def zero_state_bound(schedule: str = "1f1b") -> dict[str, Any]:
    """One AdamW step of the dp2 x pp2 tied GPT without and with ``parallel.shard=optimizer``:
    the bytes of optimizer state this rank holds (AdamW's exp_avg, exp_avg_sq and step, counted
    from the live tensors) and the largest single parameter's state."""
    held = {}
    for shard in ("none", "optimizer"):
        trainer = build_run(make_config(2, schedule, 2, parallel__shard=shard), torch.device("cpu"))
        trainer.train_step(0)
        state = local_optimizer(trainer.loop.update.optimizer).state
        held[shard] = [_state_bytes(state.get(p, {})) for p in trainer.parts.params]  # 0: owned by another dp rank
    return {"sharded": sum(held["optimizer"]), "unsharded": sum(held["none"]), "largest": max(held["none"]),
            "owned": sum(1 for b in held["optimizer"] if b), "params": len(held["none"])}


def precision_vs_fp32(precision: str, dp: int = 1, schedule: str = "1f1b") -> dict[str, float]:
    """Gradients of one step under `precision` against fp32 (float32 weights), and the dtype of
    what crossed the stage boundary."""
    out: dict[str, Any] = {}
    grads = {}
    for prec in ("fp32", precision):
        cfg = make_config(dp, schedule, 2, train__param_dtype="float32", train__precision=prec)
        trainer = build_run(cfg, torch.device("cpu"))
        trainer.forward_backward(0)
        grads[prec] = [p.grad.clone() for p in trainer.parts.params]
        out[f"edge_dtypes_{prec}"] = sorted({str(m.dtype) for plan in trainer.loop.pipeline.shapes.edges.values() for metas in plan for m in metas})
    out["grad"] = max(rel_diff(a, b) for a, b in zip(grads[precision], grads["fp32"]))
    return out


def precision_trains(precision: str, steps: int = 30) -> dict[str, float]:
    """The loss falls under `precision` (float32 master weights)."""
    cfg = make_config(1, "1f1b", 2, train__param_dtype="float32", train__precision=precision, train__max_steps=steps,
                      optim__lr=3e-2, optim__grad_clip=1.0)
    trainer = build_run(cfg, torch.device("cpu"))
    losses = [trainer.train_step(step)[0] for step in range(steps)]
    return {"first": sum(losses[:3]) / 3, "last": sum(losses[-3:]) / 3,
            "dtypes": sorted({str(p.dtype) for p in trainer.parts.params})}


def fp16_overflow_skips_everywhere(inject_on_pp_rank: int = 1, check_finite: bool = False, **overrides: Any) -> dict[str, Any]:
    """An inf in one stage's gradient at step 0 skips the step on every rank; step 1 then runs
    (with `check_finite` too: an overflow is the loss scaler's, not a NonFiniteError)."""
    cfg = make_config(dist.get_world_size() // 2 if dist.get_world_size() > 2 else 1, "1f1b", 2,
                      train__param_dtype="float32", train__precision="fp16", train__check_finite=check_finite, **overrides)
    trainer = build_run(cfg, torch.device("cpu"))
    armed = [True]
    if trainer.topology.mesh.pp_rank == inject_on_pp_rank and trainer.topology.mesh.dp_rank == 0:  # overflow inside backward
        trainer.parts.params[0].register_hook(lambda g: torch.full_like(g, float("inf")) if armed[0] else g)
    before = [p.detach().clone() for p in trainer.parts.params]
    scale0 = trainer.loop.update.scaler.scale
    _, norm0 = trainer.train_step(0)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, trainer.parts.params))
    scale1 = trainer.loop.update.scaler.scale
    armed[0] = False
    _, norm1 = trainer.train_step(1)
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.parts.params))
    return {"skipped": unchanged, "finite0": math.isfinite(norm0), "scale_ratio": scale1 / scale0,
            "stepped_after": changed, "finite1": math.isfinite(norm1)}


def check_finite_raises(precision: str, fault: str, inject_on_pp_rank: int = 1, checked: bool = True) -> str:
    """``train.check_finite=true`` through the Trainer on one replica of one pipeline rank:
    `fault` "inf-grad" (an inf in a parameter gradient at step 0; with fp16 the loss scale is
    set to its minimum first, where a lower scale cannot help) or "nan-param" (a NaN weight, so
    the forward output is non-finite).  Without `checked` (``train.check_finite=false``) the check
    that always runs must stop it too.  Returns the error's text, the same on every rank."""
    cfg = make_config(dist.get_world_size() // 2 if dist.get_world_size() > 2 else 1, "1f1b", 2,
                      train__param_dtype="float32", train__precision=precision, train__check_finite=checked)
    trainer = build_run(cfg, torch.device("cpu"))
    if precision == "fp16" and fault == "inf-grad":
        trainer.loop.update.scaler.scale = trainer.loop.update.scaler.min_scale
    if trainer.topology.mesh.pp_rank == inject_on_pp_rank and trainer.topology.mesh.dp_rank == 0:
        if fault == "inf-grad":
            trainer.parts.params[0].register_hook(lambda g: torch.full_like(g, float("inf")))
        else:
            with torch.no_grad():
                trainer.parts.params[0].fill_(float("nan"))
    try:
        trainer.train_step(0)
    except Exception as exc:  # noqa: BLE001 - the test compares the type and text on every rank
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def diverging_run_saves_nothing_non_finite(lr: float) -> dict[str, Any]:
    """``optim.lr`` huge, a checkpoint every step, ``train.check_finite=false``: the run stops with a
    NonFiniteError and ``latest`` names a checkpoint whose every tensor is finite (or none)."""
    from pipeflow.checkpoint.saving import find_latest

    cfg = make_config(1, "1f1b", 2, train__param_dtype="float32", train__max_steps=6, train__save_every=1, optim__lr=lr)
    trainer = build_run(cfg, torch.device("cpu"))
    try:
        trainer.fit()
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - the test compares the type and text on every rank
        error = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    latest = find_latest(trainer.checkpoint_root)
    finite = None if latest is None or dist.get_rank() else all(torch.isfinite(v).all() for v in _exported(latest).values())
    return {"error": error, "latest": None if latest is None else os.path.basename(latest), "finite": finite}


def non_finite_weights_are_not_saved() -> dict[str, Any]:
    """An inf weight on pipeline rank 1 (what a huge learning rate can make of finite
    gradients): the save is refused on every rank and nothing is written."""
    from pipeflow.checkpoint.saving import find_latest

    trainer = build_run(make_config(1, "1f1b", 2, train__param_dtype="float32"), torch.device("cpu"))
    if trainer.topology.mesh.pp_rank == 1:
        with torch.no_grad():
            trainer.parts.params[0].fill_(float("inf"))
    try:
        trainer.save_checkpoint(1)
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - the test compares the type and text on every rank
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "latest": find_latest(trainer.checkpoint_root)}


def offload_run_summary(mode: str = "all", schedule: str = "gpipe", m: int = 4) -> dict[str, Any]:
    """A whole run (``fit``) on pp 4 with ``pipeline.offload`` and the profile on: its summary's
    bytes offloaded per pipeline rank beside the prediction, and the measured peak beside the
    predicted one; the same run without offloading beside it."""
    out: dict[str, Any] = {}
    for offload in (mode, "none"):
        cfg = make_config(1, schedule, m, pipeline__offload=offload, pipeline__profile=True, train__max_steps=2,
                          metrics__memory_steps=[1], metrics__rehearse_steps=0)
        trainer = build_run(cfg, torch.device("cpu"))
        out[offload] = {k: v for k, v in trainer.fit().items()
                        if k in ("tensor_mb", "tensor_predicted_mb", "offloaded_mb", "offloaded_predicted_mb")}
        out[offload]["groups"] = len(trainer.plan.layout.offload.reloads)
    return out


def _shared_dir(prefix: str) -> str:
    """A fresh directory made by rank 0 (under $TMP_ENV if set), its path on every rank."""
    box = [tempfile.mkdtemp(prefix=prefix, dir=os.environ.get(TMP_ENV)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fit(dp: int, run_dir: str, resume: str | None = None, m: int = 2, dtype: str = "float32", shard: str = "none",
         **overrides: Any) -> Trainer:
    cfg = make_config(dp, "1f1b", m, train__param_dtype=dtype, train__max_steps=6, train__save_every=3,
                      train__run_dir=run_dir, train__resume=resume, optim__grad_clip=1.0, parallel__shard=shard,
                      **overrides)
    trainer = build_run(cfg, torch.device("cpu"))
    trainer.fit()
    return trainer


def _exported(path: str) -> dict[str, torch.Tensor]:
    from pipeflow.checkpoint.saving import export

    out = path.rstrip("/") + ".export.pt"
    export(path, out)
    return torch.load(out)


def _optimizer_saved(path: str) -> dict[str, torch.Tensor]:
    """Every ``optim.`` entry of checkpoint `path`, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in entries.items() if key.startswith("optim.")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def resume_across_layouts() -> dict[str, Any] | None:
    """6 steps straight (dp1 x pp4) vs 3 steps then resume for 3: same layout (bit for bit in
    float32), dp2 x pp2 and dp4 x pp1 (to float64 rounding).  The step-6 checkpoints are compared through their
    one-file exports, which must also load into the unsplit model.  Rank 0 returns the figures.

    ``parallel.shard=optimizer`` (ZeRO-1) in float64, model and AdamW state of the step-6
    checkpoints against the straight run: dp2 x pp2 ZeRO-1 straight; its step 3 resumed with
    dp1 x pp4 unsharded; the straight step 3 resumed with dp2 x pp2 and dp4 x pp1 ZeRO-1."""
    from pipeflow.checkpoint.saving import find_latest

    straight = {dtype: _fit(1, _shared_dir("pf-straight-"), dtype=dtype) for dtype in ("float32", "float64")}
    step3 = {dtype: f"{trainer.checkpoint_root}/step_00000003" for dtype, trainer in straight.items()}
    zero = _fit(2, _shared_dir("pf-zero-"), dtype="float64", shard="optimizer")
    runs = (("same", 1, "float32", step3["float32"], "none"), ("dp2xpp2", 2, "float64", step3["float64"], "none"),
            ("dp4xpp1", 4, "float64", step3["float64"], "none"),
            ("zero_to_dp1xpp4", 1, "float64", f"{zero.checkpoint_root}/step_00000003", "none"),
            ("to_zero_dp2xpp2", 2, "float64", step3["float64"], "optimizer"),
            ("to_zero_dp4xpp1", 4, "float64", step3["float64"], "optimizer"))
    resumed = {name: (dtype, _fit(dp, _shared_dir(f"pf-{name}-"), resume=source, dtype=dtype, shard=shard))
               for name, dp, dtype, source, shard in runs}
    # saved by dp1 x pp4, resumed by dp2 x pp2 with pp outermost (pipelines [0, 2] [1, 3])
    resumed["dp2xpp2_order_pp_dp_tp"] = ("float64", _fit(2, _shared_dir("pf-order-"), resume=step3["float64"],
                                                         dtype="float64", parallel__order="[pp,dp,tp]"))
    resumed["zero_straight"] = ("float64", zero)
    val = straight["float32"].evaluate()
    if dist.get_rank() != 0:
        return None
    references = {dtype: _exported(find_latest(t.checkpoint_root)) for dtype, t in straight.items()}
    optim_ref = _optimizer_saved(find_latest(straight["float64"].checkpoint_root))
    reference = references["float32"]
    out: dict[str, Any] = {f"straight_history_{d}": t.history for d, t in straight.items()}
    out["keys"] = len(reference)
    out["optim_keys"] = len(optim_ref)
    for name, (dtype, trainer) in resumed.items():
        reference = references[dtype]
        got = _exported(find_latest(trainer.checkpoint_root))
        out[f"{name}_same_keys"] = sorted(got) == sorted(reference)
        out[f"{name}_bitwise"] = all(torch.equal(got[k], reference[k]) for k in reference)
        out[f"{name}_param"] = max(rel_diff(got[k], reference[k]) for k in reference)
        out[f"{name}_history"] = trainer.history
        if dtype == "float64":  # the AdamW state (exp_avg, exp_avg_sq, step) of every parameter
            optim = _optimizer_saved(find_latest(trainer.checkpoint_root))
            out[f"{name}_same_optim_keys"] = sorted(optim) == sorted(optim_ref)
            out[f"{name}_optim"] = max((rel_diff(optim[k], optim_ref[k]) for k in optim_ref if k in optim), default=math.inf)
    # the export loads into the plain unsplit model and gives the trained model's held-out loss
    spec = instantiate(straight["float32"].cfg.model)
    model = torch.nn.ModuleList(spec.build_all())
    model.load_state_dict(references["float32"], strict=True)
    x, y = straight["float32"].plan.batches.val.get(0)
    with torch.no_grad():
        out["export_val_loss"] = float(spec.loss_fn(run_layers(list(model), x), y))
    out["trainer_val_loss"] = val
    return out


def resume_across_tp(dp: int = 1, shard: str = "none") -> dict[str, Any] | None:
    """Checkpoints across tensor-parallel degrees (float64): 6 steps of tp 2 and of tp 1 straight
    (pp = world / (dp x tp)); the tp 2 run's step 3 resumed with tp 1, and the tp 1 run's step 3
    resumed with tp 2 (sequence parallel); every step-6 checkpoint's export (whole tensors)
    against the tp 1 straight run's.  Rank 0 returns the figures."""
    from pipeflow.checkpoint.saving import find_latest

    tp1 = _fit(dp, _shared_dir("pf-tp1-"), dtype="float64", shard=shard)
    tp2 = _fit(dp, _shared_dir("pf-tp2-"), dtype="float64", shard=shard, parallel__tp=2)
    runs = {"tp2_to_tp1": _fit(dp, _shared_dir("pf-tp2to1-"), dtype="float64", shard=shard,
                               resume=f"{tp2.checkpoint_root}/step_00000003"),
            "tp1_to_tp2_sp": _fit(dp, _shared_dir("pf-tp1to2-"), dtype="float64", shard=shard, parallel__tp=2,
                                  parallel__sequence_parallel=True, resume=f"{tp1.checkpoint_root}/step_00000003"),
            "tp2_straight": tp2}
    if dist.get_rank() != 0:
        return None
    reference = _exported(find_latest(tp1.checkpoint_root))
    out: dict[str, Any] = {"keys": len(reference), "tp1_history": tp1.history}
    for name, trainer in runs.items():
        got = _exported(find_latest(trainer.checkpoint_root))
        out[f"{name}_same_keys"] = sorted(got) == sorted(reference)
        out[f"{name}_shapes"] = all(got[k].shape == reference[k].shape for k in reference if k in got)
        out[f"{name}_param"] = max(rel_diff(got[k], reference[k]) for k in reference if k in got)
        out[f"{name}_history"] = trainer.history
    return out


def resume_into_another_model_is_refused() -> str:
    """A checkpoint of one model loaded into a model with more layers: a clear ConfigError."""
    run_dir = _shared_dir("pf-wrong-")
    _fit(1, run_dir)
    cfg = make_config(1, "1f1b", 2, train__param_dtype="float32", train__resume=f"{run_dir}/checkpoints", model__n_layer=6)
    try:
        build_run(cfg, torch.device("cpu")).fit()
    except Exception as exc:  # noqa: BLE001 - the test asserts the type
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def reduction_overlaps_cooldown(schedule: str = "interleaved_1f1b", m: int = 2) -> dict[str, Any]:
    """With two stages per rank, the dp all-reduce of the stage that finishes first is posted
    before the rank's last compute action (while the cooldown still runs)."""
    trainer = build_run(make_config(2, schedule, m), torch.device("cpu"))
    recorder = trainer.loop.pipeline.recorder
    recorder.start()
    posted: list[tuple[int, int]] = []
    ready = trainer.loop.pipeline.on_stage_grads_ready

    def record(s: int) -> None:
        posted.append((s, sum(1 for e in recorder.events if e.kind != "comm")))
        ready(s)

    trainer.loop.pipeline.on_stage_grads_ready = record  # the test listens in on the builder's hook
    trainer.forward_backward(0)
    actions = sum(1 for e in recorder.stop() if e.kind != "comm")
    return {"posted": posted, "actions": actions, "stages": sorted(trainer.parts.stages)}


def owned_timeouts_and_watchdog_lifecycle() -> dict[str, Any]:
    """A dp2 x pp2 tied GPT run: the timeout of every group it uses (world, the mesh's pp and dp
    groups, the tie group) before its first step and after its last; and a watchdog built as on
    CUDA (here on the CPU) that ``fit`` stops and joins, after which the Trainer can be freed."""
    from unittest import mock

    from pipeflow.run import builder, guard
    from pipeflow.runtime.world.timeouts import group_timeout_s
    from pipeflow.runtime.transport import DeadlineWatchdog

    cfg = make_config(2, "1f1b", 2, comm__timeout_s=40.0, comm__first_step_timeout_s=100.0, train__max_steps=2)
    made: list[DeadlineWatchdog] = []

    def watchdog(device: torch.device, rank: int) -> DeadlineWatchdog:
        made.append(DeadlineWatchdog(functools.partial(guard.fail, rank=rank), device=device))
        return made[-1]

    with mock.patch.object(builder, "watchdog", watchdog):
        trainer = build_run(cfg, torch.device("cpu"))
    groups = {"world": None, "pp": trainer.topology.mesh.pp_group, "dp": trainer.topology.mesh.dp_group}
    groups.update({f"tie {t.name}": t.group for t in trainer.parts.tied.ties if t.group is not None})
    first = {name: group_timeout_s(g) for name, g in groups.items()}
    alive = made[0].alive and trainer.loop.pipeline.comm.watchdog is made[0]
    trainer.fit()
    steady = {name: group_timeout_s(g) for name, g in groups.items()}
    ref = weakref.ref(trainer)
    del trainer
    gc.collect()
    return {"first": first, "steady": steady, "alive_while_built": alive, "alive_after_fit": made[0].alive,
            "trainer_freed": ref() is None}


def full_shard_gathers_and_reduces_once_per_step(schedule: str = "1f1b", m: int = 4) -> dict[str, Any]:
    """``parallel.shard=full`` on dp2 x pp2: how many all-gathers and reduce-scatters FSDP2 ran in
    2 steps of `m` micro-batches (counted where FSDP2 issues them), the program's shard events, and
    what is left between steps: the parameters, their gradients and AdamW state as dim-0 shards."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group

    trainer = build_run(make_config(2, schedule, m, parallel__shard="full"), torch.device("cpu"))
    counts = {"all_gather": 0, "reduce_scatter": 0}
    gather, reduce = fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    fsdp_group.foreach_all_gather = counted("all_gather", gather)
    fsdp_group.foreach_reduce = counted("reduce_scatter", reduce)
    try:
        trainer.train_step(0)  # shapes are learned here: the first pass gathers before it
        trainer.loop.pipeline.recorder.start()
        trainer.train_step(1)
        timed = trainer.loop.pipeline.recorder.stop()
        events = [(e.kind, e.name) for e in timed if e.kind == "shard"]
        # a gather or reduction is its own event, inside no batched call's (counted once as communication)
        nested = [(c.name, s.name) for s in timed if s.kind == "shard" for c in timed
                  if c.kind == "comm" and c.start < s.start and s.end < c.end]
    finally:
        fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce = gather, reduce
    params = trainer.parts.params
    return {
        "counts": counts, "events": events, "nested": nested, "units": trainer.loop.pipeline.sharding.unit_stages(),
        "stages": sorted(trainer.parts.stages), "reducer": trainer.parts.reducer is not None,
        "params_sharded": all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() or p.shape[0] < 2
                              for p in params),
        "state_sharded": all(isinstance(trainer.loop.update.optimizer.state[p]["exp_avg"], DTensor) for p in params),
        "local_numel": sum(p.to_local().numel() for p in params), "numel": sum(p.numel() for p in params),
    }


def resume_across_shard_modes() -> dict[str, Any] | None:
    """Checkpoints between dp2 x pp2 ``parallel.shard=full`` and dp1 x pp4 ``none``, both ways
    (float64): 6 steps straight with none, then full resumed from its step 3; 6 steps straight
    with full, then none resumed from its step 3.  Rank 0 returns the loss histories and the
    step-6 exports' worst relative differences from the straight none run."""
    from pipeflow.checkpoint.saving import find_latest

    straight_none = _fit(1, _shared_dir("pf-none-"), dtype="float64")
    to_full = _fit(2, _shared_dir("pf-to-full-"), resume=f"{straight_none.checkpoint_root}/step_00000003",
                   dtype="float64", shard="full")
    straight_full = _fit(2, _shared_dir("pf-full-"), dtype="float64", shard="full")
    to_none = _fit(1, _shared_dir("pf-to-none-"), resume=f"{straight_full.checkpoint_root}/step_00000003",
                   dtype="float64")
    if dist.get_rank() != 0:
        return None
    reference = _exported(find_latest(straight_none.checkpoint_root))
    out: dict[str, Any] = {"straight_none": straight_none.history}
    for name, trainer in (("to_full", to_full), ("straight_full", straight_full), ("to_none", to_none)):
        got = _exported(find_latest(trainer.checkpoint_root))
        out[f"{name}_same_keys"] = sorted(got) == sorted(reference)
        out[f"{name}_param"] = max(rel_diff(got[k], reference[k]) for k in reference)
        out[f"{name}_history"] = trainer.history
    return out


def fp16_overflow_skips_sharded() -> dict[str, Any]:
    """``parallel.shard=full`` under fp16: an inf gradient in one replica of pipeline rank 1 at step 0
    (made inside backward, at its first layer's output) skips the step on every rank, the loss
    scale halves, and step 1 then runs."""
    cfg = make_config(2, "1f1b", 2, train__param_dtype="float32", train__precision="fp16", parallel__shard="full")
    trainer = build_run(cfg, torch.device("cpu"))
    armed = [True]

    def poison(module: Any, args: Any, out: torch.Tensor) -> None:
        if armed[0] and out.requires_grad:
            out.register_hook(lambda g: torch.full_like(g, float("inf")))

    if trainer.topology.mesh.pp_rank == 1 and trainer.topology.mesh.dp_rank == 0:
        trainer.parts.stages[1].module[0].register_forward_hook(poison)
    before = [p.detach().to_local().clone() for p in trainer.parts.params]
    scale0 = trainer.loop.update.scaler.scale
    _, norm0 = trainer.train_step(0)
    unchanged = all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, trainer.parts.params))
    armed[0] = False
    scale1 = trainer.loop.update.scaler.scale
    _, norm1 = trainer.train_step(1)
    changed = any(not torch.equal(a, p.detach().to_local()) for a, p in zip(before, trainer.parts.params))
    return {"skipped": unchanged, "finite0": math.isfinite(norm0), "scale_ratio": scale1 / scale0,
            "stepped_after": changed, "finite1": math.isfinite(norm1)}


def full_shard_vs_replicas_under(precision: str) -> dict[str, float]:
    """dp2 x pp2 under `precision` (autocast, float32 weights): the gradients of one step with
    ``parallel.shard=full`` against ``none`` (gathered whole), and the loss of each."""
    grads, losses = {}, {}
    for shard in ("none", "full"):
        cfg = make_config(2, "1f1b", 2, train__param_dtype="float32", train__precision=precision, parallel__shard=shard)
        trainer = build_run(cfg, torch.device("cpu"))
        losses[shard], _ = trainer.forward_backward(0)
        grads[shard] = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in trainer.parts.params]
    return {"grad": max(rel_diff(a, b) for a, b in zip(grads["full"], grads["none"])),
            "loss": abs(losses["full"] - losses["none"]) / abs(losses["none"])}
