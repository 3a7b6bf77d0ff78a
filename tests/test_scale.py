"""Scale-out on 4 gloo processes: the dp x pp mesh equals the unsplit model on the global batch
(float64), also with the AdamW state sharded (``parallel.shard=optimizer``), global clipping,
mixed precision, activation checkpointing, checkpoints.

All cases run inside one process group (tests/mp_harness.py); each builds a real Trainer.
"""
from __future__ import annotations

import functools

import pytest

import masked_cases
import moe_cases
import scale_cases as cases
from mp_harness import CaseResult, run_cases, selected_cases

TOLERANCE = 1e-9
CLIP = 0.05
WORLD = 4

COMPILED = {"train__compile": True, "train__compile_backend": "aot_eager"}
EQUIVALENCE = {  # name: (dp, schedule, m, overrides); pp = 4 / dp
    "dp2xpp2-1f1b": (2, "1f1b", 2, {}),
    "dp2xpp2-zb_h1": (2, "zb_h1", 2, {}),
    "dp2xpp2-zbv": (2, "zbv", 3, {}),  # V placement: both tied copies on pipeline rank 0
    "dp2xpp2-interleaved": (2, "interleaved_1f1b", 2, {}),
    "dp4xpp1": (4, "1f1b", 1, {}),
    "dp1xpp4-gpipe": (1, "gpipe", 3, {}),
    "dp1xpp4-zb_h1-recvs-at-step": (1, "zb_h1", 4, {"comm__post_recvs": "at_step"}),
    "dp2xpp2-clipped": (2, "1f1b", 2, {"optim__grad_clip": CLIP}),
    "dp1xpp4-clipped": (1, "1f1b", 2, {"optim__grad_clip": CLIP}),
    "dp2xpp2-actckpt": (2, "1f1b", 2, {"pipeline__checkpoint_activations": True}),
    "dp1xpp4-zb_h1-actckpt": (1, "zb_h1", 2, {"pipeline__checkpoint_activations": True}),
    "dp2xpp2-zb_h1-actckpt2": (2, "zb_h1", 2, {"pipeline__checkpoint_activations": 2}),
    # micro-batches of different shapes: a batch that does not split evenly over dp x m, and
    # data.variable_lengths (each micro-batch its own sequence length), through the Trainer
    "dp2xpp2-uneven-rows": (2, "1f1b", 2, {"data__batch_size": 27}),
    "dp2xpp2-zbv-variable-lengths": (2, "zbv", 3, {"data__variable_lengths": True, "data__min_seq_len": 3}),
    "dp1xpp4-variable-lengths-uneven": (1, "1f1b", 3, {"data__variable_lengths": True, "data__batch_size": 25}),
    # parallel.shard=optimizer (ZeRO-1): AdamW state and update sharded over each dp group.  The
    # GPT is tied: 1F1B and interleaved hold the tied copies on two ranks, ZB-V on one
    "dp2xpp2-1f1b-zero": (2, "1f1b", 2, {"parallel__shard": "optimizer"}),
    "dp2xpp2-interleaved-zero": (2, "interleaved_1f1b", 2, {"parallel__shard": "optimizer"}),
    "dp2xpp2-zbv-zero": (2, "zbv", 3, {"parallel__shard": "optimizer"}),
    "dp2xpp2-zb_h1-zero-clipped": (2, "zb_h1", 2, {"parallel__shard": "optimizer", "optim__grad_clip": CLIP}),
    "dp1xpp4-zero": (1, "1f1b", 2, {"parallel__shard": "optimizer"}),  # dp = 1: nothing to shard
    # parallel.shard=full (FSDP2 over each stage's dp group), tied embeddings in every case: across
    # pipeline ranks (1F1B, interleaved) and in one FSDP2 unit on one rank (ZB-V's V placement)
    "dp2xpp2-full-1f1b": (2, "1f1b", 2, {"parallel__shard": "full"}),
    "dp2xpp2-full-interleaved": (2, "interleaved_1f1b", 2, {"parallel__shard": "full", "train__check_finite": True}),
    "dp2xpp2-full-zbv": (2, "zbv", 3, {"parallel__shard": "full"}),
    "dp2xpp2-full-zb_h1-clipped-actckpt": (2, "zb_h1", 2, {"parallel__shard": "full", "optim__grad_clip": CLIP,
                                                           "pipeline__checkpoint_activations": True}),
    "dp1xpp4-full": (1, "1f1b", 2, {"parallel__shard": "full"}),  # dp = 1: nothing to shard
    # optim.fused=true (fused AdamW; CPU default off) in each shard mode, against the unfused reference
    "dp2xpp2-1f1b-fused": (2, "1f1b", 2, {"optim__fused": True}),
    "dp2xpp2-1f1b-zero-fused": (2, "1f1b", 2, {"parallel__shard": "optimizer", "optim__fused": True}),
    "dp2xpp2-full-1f1b-fused": (2, "1f1b", 2, {"parallel__shard": "full", "optim__fused": True}),
    # the start-of-run rehearsal (profiled layers, metrics.rehearse_steps) runs the stages on the
    # first batch before step 0 and must leave no trace: no gradient, buffer or random draw
    "dp2xpp2-zb_h1-rehearsed": (2, "zb_h1", 2, {"pipeline__profile": True, "metrics__rehearse_steps": 2}),
    "dp1xpp4-variable-lengths-rehearsed": (1, "1f1b", 3, {"data__variable_lengths": True, "data__batch_size": 25,
                                                          "pipeline__profile": True, "metrics__rehearse_steps": 2}),
    # train.compile (aot_eager: the graphs without code generation), FSDP2 and ZeRO-1 around compiled layers
    "dp2xpp2-full-zbv-compiled": (2, "zbv", 3, {"parallel__shard": "full", **COMPILED}),
    "dp2xpp2-zb_h1-zero-actckpt-compiled": (2, "zb_h1", 2, {"parallel__shard": "optimizer",
                                                            "pipeline__checkpoint_activations": True, **COMPILED}),
    # parallel.tp: pp 2 x tp 2, each stage's layers split over 2 ranks (DTensor plans; the GPT's
    # tied embedding and head vocabulary-split on pipeline ranks 0 and 1), with and without
    # sequence parallelism
    "dp1xpp2xtp2-1f1b-clipped": (1, "1f1b", 2, {"parallel__tp": 2, "optim__grad_clip": CLIP}),
    "dp1xpp2xtp2-1f1b-sp": (1, "1f1b", 2, {"parallel__tp": 2, "parallel__sequence_parallel": True}),
    "dp1xpp2xtp2-interleaved-sp": (1, "interleaved_1f1b", 2, {"parallel__tp": 2, "parallel__sequence_parallel": True}),
    "dp1xpp2xtp2-zbv": (1, "zbv", 2, {"parallel__tp": 2}),
    "dp1xpp2xtp2-zbv-sp-actckpt": (1, "zbv", 2, {"parallel__tp": 2, "parallel__sequence_parallel": True,
                                                 "pipeline__checkpoint_activations": True}),
    "dp1xpp2xtp2-dualpipev": (1, "dualpipev", 4, {"parallel__tp": 2}),
    # train.compile with tp: 1F1B with the sequence-parallel collectives inside the compiled graphs
    # (split-backward stages stay eager with tp: runtime/compile_phase.py says why)
    "dp1xpp2xtp2-1f1b-sp-compiled": (1, "1f1b", 2, {"parallel__tp": 2, "parallel__sequence_parallel": True,
                                                    **COMPILED}),
    "dp1xpp2xtp2-v_min-variable-lengths": (1, "v_min", 4, {"parallel__tp": 2, "data__variable_lengths": True,
                                                         "data__min_seq_len": 3}),
    # pipeline.offload: every group's saved activations to a second buffer and back (the CPU's
    # copies), over dp (FSDP2 with checkpointing; ZeRO-1 with variable lengths) and tp (DTensor
    # activations stay: only plain tensors move); auto on the CPU, where no gap hides a copy
    "dp2xpp2-zbv-offload-all": (2, "zbv", 3, {"pipeline__offload": "all"}),
    "dp2xpp2-full-1f1b-offload-all-actckpt": (2, "1f1b", 2, {"parallel__shard": "full", "pipeline__offload": "all",
                                                             "pipeline__checkpoint_activations": 2}),
    "dp2xpp2-v_min-zero-offload-all-variable-lengths": (2, "v_min", 4, {
        "parallel__shard": "optimizer", "pipeline__offload": "all", "data__variable_lengths": True,
        "data__min_seq_len": 3}),
    "dp1xpp2xtp2-1f1b-offload-all": (1, "1f1b", 2, {"parallel__tp": 2, "pipeline__offload": "all"}),
    "dp2xpp2-1f1b-offload-auto": (2, "1f1b", 2, {"pipeline__offload": "auto", "pipeline__profile": True}),
    "dp2xpp2-zb_h1-offload-all-compiled": (2, "zb_h1", 2, {"pipeline__offload": "all", **COMPILED}),
    # schedule=auto synthesised with the offload plan in view (profiled costs and bytes)
    "dp2xpp2-auto-offload-all-profiled": (2, "auto", 2, {"pipeline__offload": "all", "pipeline__profile": True}),
    "dp2xpp2-full-zbv-variable-lengths-recvs-at-step": (2, "zbv", 3, {
        "parallel__shard": "full", "data__variable_lengths": True, "data__min_seq_len": 3, "comm__post_recvs": "at_step"}),
    # parallel.order: pp outermost (pipelines [0, 2] [1, 3], dp groups consecutive), FSDP2 over
    # them; tp outermost (each tp group's ranks 2 apart)
    "dp2xpp2-1f1b-order-pp-dp-tp": (2, "1f1b", 2, {"parallel__order": ["pp", "dp", "tp"]}),
    "dp2xpp2-full-zbv-order-pp-dp-tp": (2, "zbv", 3, {"parallel__order": ["pp", "dp", "tp"], "parallel__shard": "full"}),
    "dp1xpp2xtp2-1f1b-order-tp-pp-dp": (1, "1f1b", 2, {"parallel__tp": 2, "parallel__order": ["tp", "pp", "dp"]}),
}


def _cases() -> list[tuple[str, object]]:
    eq = [
        (name, functools.partial(cases.dp_equivalence, dp, schedule, m, **overrides))
        for name, (dp, schedule, m, overrides) in EQUIVALENCE.items()
    ]
    return eq + [
        ("bf16-vs-fp32", functools.partial(cases.precision_vs_fp32, "bf16", 2)),
        ("fp16-vs-fp32", functools.partial(cases.precision_vs_fp32, "fp16", 1)),
        ("bf16-trains", functools.partial(cases.precision_trains, "bf16")),
        ("fp16-overflow", cases.fp16_overflow_skips_everywhere),
        ("fp16-overflow-checked", functools.partial(cases.fp16_overflow_skips_everywhere, check_finite=True)),
        ("fp16-overflow-zero", functools.partial(cases.fp16_overflow_skips_everywhere, parallel__shard="optimizer")),
        ("zero-state-bound", cases.zero_state_bound),
        ("fp16-overflow-full-shard", cases.fp16_overflow_skips_sharded),
        ("bf16-full-shard", functools.partial(cases.full_shard_vs_replicas_under, "bf16")),
        ("fp16-min-scale-checked", functools.partial(cases.check_finite_raises, "fp16", "inf-grad")),
        ("fp16-nan-forward-checked", functools.partial(cases.check_finite_raises, "fp16", "nan-param")),
        ("fp32-inf-grad-checked", functools.partial(cases.check_finite_raises, "fp32", "inf-grad")),
        ("fp32-inf-grad-unchecked", functools.partial(cases.check_finite_raises, "fp32", "inf-grad", checked=False)),
        ("fp32-nan-param-unchecked", functools.partial(cases.check_finite_raises, "fp32", "nan-param", checked=False)),
        ("diverge-loss", functools.partial(cases.diverging_run_saves_nothing_non_finite, 1e30)),
        ("inf-weights", cases.non_finite_weights_are_not_saved),
        ("resume", cases.resume_across_layouts),
        ("resume-shard", cases.resume_across_shard_modes),
        ("resume-tp", cases.resume_across_tp),
        ("offload-summary", cases.offload_run_summary),
        ("tp-bf16", functools.partial(cases.dp_equivalence, 1, "1f1b", 2, 1, train__precision="bf16",
                                      train__param_dtype="float32", parallel__tp=2)),
        ("tp-fp16", functools.partial(cases.dp_equivalence, 1, "1f1b", 2, 1, train__precision="fp16",
                                      train__param_dtype="float32", parallel__tp=2)),
        ("full-shard-counts", functools.partial(cases.full_shard_gathers_and_reduces_once_per_step, "zbv", 4)),
        ("overlap", cases.reduction_overlaps_cooldown),
        ("timeouts-watchdog", cases.owned_timeouts_and_watchdog_lifecycle),
        ("wrong-model", cases.resume_into_another_model_is_refused),
        ("moe-fit", moe_cases.moe_trainer_fit),  # issue 45: the Trainer's path of the MoE aux loss and statistics
        ("moe-fit-ep", functools.partial(moe_cases.moe_trainer_fit, ep=2)),  # parallel.ep=2 = dp, resumed at ep 1
        ("moe-fit-ep-dp4", functools.partial(moe_cases.moe_trainer_fit, ep=2, pp=1)),  # ep 2 < dp 4
    ] + [(f"deferred-{name}", functools.partial(cases.deferred_equivalence, dp, schedule, m, **overrides))
         for name, (dp, schedule, m, overrides) in DEFERRED.items()] + [
        (f"masked-{name}", functools.partial(masked_cases.masked_equivalence, dp, schedule, m, **overrides))
        for name, (dp, schedule, m, overrides) in MASKED.items()] + [
        ("all-masked-step", masked_cases.all_masked_step_is_an_error)]


MASKED = {  # targets masked with -100 (a share of each batch, one micro-batch wholly): valid-token weighting
    "dp2xpp2-1f1b": (2, "1f1b", 2, {}),
    "dp2xpp2-zb_h1": (2, "zb_h1", 2, {}),
    "dp2xpp2-zbv-variable-lengths": (2, "zbv", 3, {"data__variable_lengths": True, "data__min_seq_len": 3}),
    "dp1xpp4-1f1b": (1, "1f1b", 4, {}),
    "dp1xpp2xtp2-1f1b": (1, "1f1b", 2, {"parallel__tp": 2}),  # each tp rank's last stage holds the loss
    # data=chat: conversations packed with document ids, prompts masked (prepared files)
    "dp2xpp2-zbv-chat": (2, "zbv", 3, {"chat": True}),
}


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_targets_weigh_by_the_targets_the_loss_counts(world, name: str) -> None:
    """Loss, gradients, parameters and the held-out loss equal the unsplit model's mean over the
    unmasked targets of the whole batch; an all-masked micro-batch adds nothing (never NaN)."""
    for rank, v in enumerate(_values(world[f"masked-{name}"])):
        assert v["params_compared"] > 0
        for key in ("loss", "grad", "param", "val"):
            assert v[key] <= TOLERANCE, f"{name} rank {rank}: {key} differs by {v[key]:.3e}"


def test_a_step_whose_every_target_is_masked_is_a_named_error(world) -> None:
    for rank, text in enumerate(_values(world["all-masked-step"])):  # pp = 2: every rank holds the batch
        assert text.startswith("AllTargetsMaskedError: training batch 1: every target is masked"), text
        assert f"rank {rank}" in text


DEFERRED = {  # Trainer.fit's step (read back a step late, fused AdamW) against the unsplit model
    "dp2xpp2-1f1b": (2, "1f1b", 2, {}),
    "dp2xpp2-zbv-full": (2, "zbv", 3, {"parallel__shard": "full"}),
    "dp1xpp4-zb_h1-check-finite": (1, "zb_h1", 2, {"train__check_finite": True}),
}


@pytest.mark.parametrize("name", list(DEFERRED))
def test_steps_read_back_a_step_late_train_as_the_unsplit_model(world, name: str) -> None:
    for v in _values(world[f"deferred-{name}"]):
        assert v["deferred"], v
        assert v["loss"] <= TOLERANCE and v["param"] <= TOLERANCE, v


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[CaseResult]]:
    with pytest.MonkeyPatch.context() as patch:  # run directories under pytest's tmp dir
        patch.setenv(cases.TMP_ENV, str(tmp_path_factory.mktemp("runs")))
        return run_cases(WORLD, selected_cases(request, _cases()))


def _values(results: list[CaseResult]) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


@pytest.mark.parametrize("name", list(EQUIVALENCE))
def test_mesh_training_equals_unsplit_model_on_global_batch(world, name: str) -> None:
    values = _values(world[name])
    assert all(v["params_compared"] > 0 for v in values)
    if "clipped" in name:  # the clip must bite, or the test proves nothing
        assert all(v["norm"] > 2 * CLIP for v in values)
    if "uneven" in name or "variable" in name:  # the builder chose every micro-batch its own shapes
        assert all(v["shapes"] == "per_microbatch" for v in values)
    assert all(v["rehearsed"] == ("rehearsed" in name) for v in values)
    assert all(v["fused"] == ("fused" in name) for v in values)
    sharded = "zero" in name and name.startswith("dp2")
    for rank, v in enumerate(values):  # ZeRO-1 owns a share of the parameters; each once in its dp group
        assert (0 < v["owned"] < v["params"]) if sharded else v["owned"] == v["params"], f"rank {rank}: {v}"
    if sharded:  # global rank d * pp + r: pipeline rank r's dp group is {r, r + 2}
        assert [values[r]["owned"] + values[r + 2]["owned"] for r in range(2)] == [values[r]["params"] for r in range(2)]
    for rank, v in enumerate(values):
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, f"{name} rank {rank}: {key} differs by {v[key]:.3e}"
        if "compiled" in name:  # every layer of the rank ran compiled
            assert v["compile"]["layers"] > 0 and v["compile"]["eager_layers"] == {}, v
        if "offload-all" in name:  # every group went out and came back (the last step's)
            assert v["offloaded"]["groups"] == v["offloaded"]["planned"] > 0 and v["offloaded"]["bytes"] > 0, v
        elif "offload-auto" in name:  # the CPU's copies take the compute thread's time: nothing hides
            assert v["offloaded"] is None, v


@pytest.mark.parametrize("precision,tolerance", [("bf16", 0.05), ("fp16", 0.01)])
def test_half_precision_gradients_agree_with_fp32_and_travel_in_half(world, precision: str, tolerance: float) -> None:
    half = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    for rank, v in enumerate(_values(world[f"{precision}-vs-fp32"])):
        assert v["grad"] < tolerance, f"rank {rank}: {precision} grads differ from fp32 by {v['grad']:.3e}"
        assert v["grad"] > 0  # autocast really ran
        assert v["edge_dtypes_fp32"] == ["torch.float32"]
        if v[f"edge_dtypes_{precision}"]:  # ranks that send or receive activations
            assert v[f"edge_dtypes_{precision}"] == [half]


def test_bf16_training_lowers_the_loss_with_fp32_master_weights(world) -> None:
    for v in _values(world["bf16-trains"]):
        assert v["last"] < v["first"] - 0.3, v
        assert v["dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("name", ["fp16-overflow", "fp16-overflow-checked", "fp16-overflow-zero",
                                  "fp16-overflow-full-shard"])
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_rank(world, name: str) -> None:
    for rank, v in enumerate(_values(world[name])):  # with train.check_finite too: no NonFiniteError
        assert v["skipped"] and not v["finite0"], f"rank {rank}: {v}"
        assert v["scale_ratio"] == 0.5
        assert v["stepped_after"] and v["finite1"], f"rank {rank}: {v}"


def test_check_finite_raises_what_the_loss_scaler_cannot_explain(world) -> None:
    grads = "non-finite values (NaN or Inf) first appeared in the parameter gradients of stage 1 (rank 1), in backward"
    for text in _values(world["fp32-inf-grad-checked"]):  # one replica of pipeline rank 1, no scaler
        assert text.startswith(f"NonFiniteError: training step 0: {grads}"), text
        assert "loss scale" not in text
    for text in _values(world["fp16-min-scale-checked"]):  # fp16 overflow at the minimum loss scale
        assert text.startswith(f"NonFiniteError: training step 0: {grads}"), text
        assert "the fp16 loss scale is already at its minimum (1)" in text
    for text in _values(world["fp16-nan-forward-checked"]):  # a NaN forward is never the scaler's
        assert text.startswith("NonFiniteError: training step 0: non-finite values (NaN or Inf) first appeared "
                               "in the forward output of stage 1 (rank 1) - the loss"), text


def test_non_finite_gradients_or_loss_always_stop_every_rank(world) -> None:
    for text in _values(world["fp32-inf-grad-unchecked"]):  # train.check_finite=false: the always-on check
        assert text.startswith("NonFiniteError: training step 0: the parameter gradients of stage 1 (pipeline rank 1) "
                               "hold NaN or Inf, so the run stops here on every rank before the optimizer step and "
                               "before any save"), text
    for text in _values(world["fp32-nan-param-unchecked"]):
        assert text.startswith("NonFiniteError: training step 0: the loss (computed on stage 1, pipeline rank 1) and "
                               "the parameter gradients of stage 0 (pipeline rank 0), stage 1 (pipeline rank 1) hold"), text


def test_a_diverging_run_never_saves_non_finite_weights(world) -> None:
    out = _values(world["diverge-loss"])  # lr 1e30: the weights stay finite, the next loss does not
    assert all(v["error"].startswith("NonFiniteError: training step ") for v in out), out[0]
    assert out[0]["latest"] is not None and out[0]["finite"], out[0]
    for v in _values(world["inf-weights"]):  # finite gradients, inf weights: the save itself refuses
        assert v["error"].startswith("NonFiniteError: checkpoint of step 1 not written: the weights of stage(s) [1] "
                                     "hold NaN or Inf"), v
        assert v["latest"] is None, v


def test_resume_equals_training_straight_through_and_survives_a_layout_change(world) -> None:
    out = _values(world["resume"])[0]
    straight = out["straight_history_float32"]
    assert len(straight) == 6 and out["keys"] > 0
    assert out["same_history"] == straight[3:]  # identical loss curve
    assert out["same_bitwise"], f"same-layout resume differs by {out['same_param']:.3e}"
    straight = out["straight_history_float64"]
    for name in ("dp2xpp2", "dp4xpp1", "dp2xpp2_order_pp_dp_tp"):  # pp 4 -> 2 -> 1, dp 1 -> 2 -> 4 (float64)
        assert out[f"{name}_same_keys"]
        assert out[f"{name}_param"] < TOLERANCE, f"{name}: {out[f'{name}_param']:.3e}"
        assert max(abs(a - b) / b for a, b in zip(out[f"{name}_history"], straight[3:])) < TOLERANCE


@pytest.mark.parametrize("precision,tolerance", [("bf16", 0.05), ("fp16", 0.01)])
def test_tensor_parallel_under_half_precision_gives_the_gradients_of_fp32(world, precision: str, tolerance: float) -> None:
    """pp 2 x tp 2 under train.precision=bf16 / fp16 (its loss scaler) against the unsplit fp32 model:
    the bounds eager half precision meets."""
    for v in _values(world[f"tp-{precision}"]):
        assert 0 < v["grad"] < tolerance and v["loss"] < tolerance, v


def test_checkpoints_resume_across_tensor_parallel_degrees(world) -> None:
    """tp 2 -> tp 1 and tp 1 -> tp 2 (sequence parallel): DCP reshards the tp-split weights; the
    exports hold whole tensors and equal the tp 1 run's after 6 steps (float64)."""
    v = _values(world["resume-tp"])[0]
    for name in ("tp2_to_tp1", "tp1_to_tp2_sp", "tp2_straight"):
        assert v[f"{name}_same_keys"] and v[f"{name}_shapes"], (name, v)
        assert v[f"{name}_param"] <= TOLERANCE, (name, v[f"{name}_param"])
        assert len(v[f"{name}_history"]) == (6 if name == "tp2_straight" else 3), v


def test_resume_across_shard_modes_restores_model_and_optimizer_state(world) -> None:
    """parallel.shard=optimizer <-> none with dp and pp changing: the step-6 model and AdamW state
    equal the straight unsharded run's (float64), and every optimizer entry was saved once."""
    out = _values(world["resume"])[0]
    straight = out["straight_history_float64"]
    assert out["optim_keys"] > 0
    for name in ("dp2xpp2", "dp4xpp1", "zero_to_dp1xpp4", "to_zero_dp2xpp2", "to_zero_dp4xpp1", "zero_straight"):
        assert out[f"{name}_same_keys"] and out[f"{name}_same_optim_keys"], name
        assert out[f"{name}_param"] < TOLERANCE, f"{name}: {out[f'{name}_param']:.3e}"
        assert out[f"{name}_optim"] < TOLERANCE, f"{name}: optimizer state differs by {out[f'{name}_optim']:.3e}"
        expected = straight if name == "zero_straight" else straight[3:]
        assert max(abs(a - b) / b for a, b in zip(out[f"{name}_history"], expected)) < TOLERANCE, name


def test_zero_holds_at_most_a_dp_share_of_the_optimizer_state_plus_the_largest_parameters(world) -> None:
    """ZeRO-1's sorted greedy partition of whole tensors: every dp rank's AdamW state is at most
    1/dp of the unsharded state plus the largest single parameter's state, and the dp group
    holds each parameter's state exactly once."""
    values = _values(world["zero-state-bound"])
    for rank, v in enumerate(values):
        assert v["sharded"] <= v["unsharded"] / 2 + v["largest"], f"rank {rank}: {v}"
        assert 0 < v["owned"] < v["params"], f"rank {rank}: {v}"
    for r in range(2):  # pipeline rank r's dp group: global ranks r and r + 2
        assert values[r]["unsharded"] == values[r + 2]["unsharded"]
        assert values[r]["sharded"] + values[r + 2]["sharded"] == values[r]["unsharded"]


def test_export_loads_into_the_unsplit_model(world) -> None:
    out = _values(world["resume"])[0]
    assert abs(out["export_val_loss"] - out["trainer_val_loss"]) < 1e-5 * out["trainer_val_loss"]


def test_resuming_another_model_names_the_missing_entries(world) -> None:
    texts = _values(world["wrong-model"])
    for text in texts:  # 6 blocks on 4 ranks: every rank holds a block the 2-block checkpoint lacks
        assert text.startswith("ConfigError: rank "), text
        assert "has no model.layers." in text and "saved from another model" in text


def test_dp_reduction_of_an_early_stage_starts_before_the_cooldown_ends(world) -> None:
    for rank, v in enumerate(_values(world["overlap"])):
        assert sorted(s for s, _ in v["posted"]) == v["stages"]  # each stage once per step
        first_done = min(at for _, at in v["posted"])
        assert first_done < v["actions"], f"rank {rank}: every reduction waited for the flush: {v}"


def test_every_group_the_run_uses_times_out_a_margin_after_pipeflows_deadline(world) -> None:
    """comm.first_step_timeout_s=100 then comm.timeout_s=40: each group 15 s later (timeouts.margin_s)."""
    for rank, v in enumerate(_values(world["timeouts-watchdog"])):
        assert sorted(v["first"]) == ["dp", "pp", "tie wte", "world"], f"rank {rank}: {v}"
        assert set(v["first"].values()) == {115.0}, f"rank {rank}: {v['first']}"
        assert set(v["steady"].values()) == {55.0}, f"rank {rank}: {v['steady']}"


def test_fit_stops_and_joins_the_watchdog_and_the_trainer_can_be_freed(world) -> None:
    for rank, v in enumerate(_values(world["timeouts-watchdog"])):
        assert v["alive_while_built"] and not v["alive_after_fit"], f"rank {rank}: {v}"
        assert v["trainer_freed"], f"rank {rank}: something still holds the Trainer after fit"


def test_full_shard_gathers_and_reduces_each_stage_once_per_step(world) -> None:
    """ZB-V, 4 micro-batches, parallel.shard=full: per step one all-gather and one reduce-scatter per
    FSDP2 unit (rank 0's two stages share the tied embedding: one unit), never per micro-batch;
    between steps parameters, gradients and AdamW state are dim-0 shards; no dp all-reduce."""
    for rank, v in enumerate(_values(world["full-shard-counts"])):
        units = len(v["units"])
        assert v["units"] == ([[0, 3]] if v["stages"] == [0, 3] else [[1], [2]]), f"rank {rank}: {v['units']}"
        assert v["counts"] == {"all_gather": 2 * units, "reduce_scatter": 2 * units}, f"rank {rank}: {v['counts']}"
        reshards = [name for _, name in v["events"] if name.startswith("reduce-scatter")]
        assert sorted(int(n.split()[-1]) for n in reshards) == v["stages"], f"rank {rank}: {v['events']}"
        assert not v["nested"], f"rank {rank}: shard events inside comm events: {v['nested']}"
        assert v["params_sharded"] and v["state_sharded"] and not v["reducer"], f"rank {rank}: {v}"
        assert v["local_numel"] * 2 == v["numel"], f"rank {rank}: {v}"  # dp = 2, even shards here


def test_full_shard_under_bf16_gives_the_gradients_of_replicas(world) -> None:
    for rank, v in enumerate(_values(world["bf16-full-shard"])):  # float32 sums in another order at most
        assert v["grad"] < 1e-5 and v["loss"] < 1e-6, f"rank {rank}: {v}"


def test_checkpoints_resume_across_shard_modes_dp_and_pp(world) -> None:
    """dp1 x pp4 shard=none -> dp2 x pp2 shard=full and back, model and AdamW state (float64):
    the losses and the exported step-6 weights equal training straight through without sharding."""
    out = _values(world["resume-shard"])[0]
    straight = out["straight_none"]
    assert len(straight) == 6
    assert max(abs(a - b) / b for a, b in zip(out["straight_full_history"], straight)) < TOLERANCE
    for name in ("to_full", "straight_full", "to_none"):
        assert out[f"{name}_same_keys"], name
        assert out[f"{name}_param"] < TOLERANCE, f"{name}: {out[f'{name}_param']:.3e}"
    for name in ("to_full", "to_none"):
        assert max(abs(a - b) / b for a, b in zip(out[f"{name}_history"], straight[3:])) < TOLERANCE, name


def test_an_offloading_run_states_its_bytes_offloaded_and_peaks_beside_the_prediction(world) -> None:
    """pipeline.offload=all with GPipe on 4 pipeline ranks: the summary's bytes offloaded per rank are
    the predicted ones, the measured peak is the predicted one (within 3%), below the run without."""
    for v in _values(world["offload-summary"]):
        moved, plain = v["all"], v["none"]
        assert moved["groups"] == 4 * 4 and plain["groups"] == 0 and "offloaded_mb" not in plain
        assert all(b > 0 for b in moved["offloaded_mb"])
        assert moved["offloaded_mb"] == pytest.approx(moved["offloaded_predicted_mb"], rel=1e-6)
        assert moved["tensor_mb"] == pytest.approx(moved["tensor_predicted_mb"], rel=0.03)
        assert all(a < b for a, b in zip(moved["tensor_mb"], plain["tensor_mb"]))


@pytest.mark.parametrize("name", ["moe-fit", "moe-fit-ep", "moe-fit-ep-dp4"])
def test_an_moe_run_trains_as_the_unsplit_model_and_reports_tokens_per_expert(world, name: str) -> None:
    """Trainer.fit on dp 2 x pp 2 with a mixture-of-experts GPT (bias balancing, aux and z-loss,
    micro-batches of different lengths): every step's loss (cross entropy + aux, read back a step
    late) and the final weights and biases equal the unsplit model's; the summary holds each MoE
    layer's tokens per expert.  With parallel.ep=2 each rank holds 2 of the 4 experts of a layer
    (on dp 4 x pp 1: each expert on 2 ranks, its gradient summed over them), and the checkpoint
    resumes with ep=1 (experts saved by global index) to the same weights."""
    for rank, v in enumerate(_values(world[name])):
        assert v["steps"] == 3 and v["bias_moved"] > 0
        own = {"moe-fit": 1, "moe-fit-ep": 1, "moe-fit-ep-dp4": 2}[name]  # MoE layers of this rank's stage
        assert v["experts_held"] == own * (2 if "-ep" in name else 4)
        if "-ep" in name:
            assert v["resumed_at"] == 3 and v["experts_after_resume"] == own * 4
            assert v["resumed"] <= TOLERANCE, f"rank {rank}: resumed at ep 1, weights differ by {v['resumed']:.3e}"
        for key in ("loss", "param"):
            assert v[key] <= TOLERANCE, f"rank {rank}: {key} differs by {v[key]:.3e}"
        layers = v["moe"]["layers"]
        # the per-stage time in the experts' all_to_alls (parallel.ep only), measured every step on the CPU
        assert all(ms > 0 if "-ep" in name else ms == 0 for ms in v["moe"]["all_to_all_ms"]), v["moe"]["all_to_all_ms"]
        assert sorted(layers) == [1, 2]  # the model's blocks 0 and 1 (layers 1, 2)
        tokens = [sum(row["tokens_per_expert"]) for row in layers.values()]  # both layers route every token twice
        assert tokens[0] == pytest.approx(tokens[1]) and tokens[0] >= 24 * 3 * 2
        assert all(row["imbalance"] >= 1 and row["dropped_per_step"] == 0 for row in layers.values())
