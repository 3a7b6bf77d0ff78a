"""parallel.tp.  In one process: the layout's arithmetic and named errors, the plans (the GPT's, a
from_module glob plan), the checks that refuse what tp cannot split, one layer split over a
one-rank mesh equal to itself, one tp rank's costs and the planner's tp search.  In this
module's 8-process world: dp 2 x pp 2 x tp 2 with FSDP2 (the GPT, a tied Llama, LoRA) against the
unsplit model, and its checkpoints across tp; the suite's one 8-process mixture-of-experts case
(pp 2 x dp 4, parallel.ep=4) shares the world.  pp 2 x tp 2 for every schedule family, with and
without sequence parallelism, and checkpoints across tp run in tests/test_scale.py's 4-process
world; model=hf's plan at pp 2 x tp 2 in tests/test_hf.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models import from_module
from pipeflow.models.gpt import GPT_BLOCK_PLAN, build_gpt
from pipeflow.models.spec import TP_STYLES, LayerSpec, ModelSpec
from pipeflow.config.schema import ParallelConfig, resolve_layout


def _parallel(**keys) -> ParallelConfig:
    return OmegaConf.structured(ParallelConfig(**keys))


def test_the_world_is_dp_x_pp_x_tp_with_pp_inferred() -> None:
    assert resolve_layout(_parallel(tp=2), 8) == (1, 4)
    assert resolve_layout(_parallel(dp=2, tp=2), 8) == (2, 2)
    assert resolve_layout(_parallel(dp=2, pp=2, tp=2), 8) == (2, 2)
    with pytest.raises(ConfigError, match="parallel.tp=3 does not divide the world size 8"):
        resolve_layout(_parallel(tp=3), 8)
    with pytest.raises(ConfigError, match=r"parallel.dp=2 x parallel.pp=4 x parallel.tp=2 = 16 processes, but the "
                                          r"world size is 8; .*set parallel.pp=2"):
        resolve_layout(_parallel(dp=2, pp=4, tp=2), 8)
    with pytest.raises(ConfigError, match="parallel.dp=3 does not divide the world size 8 / parallel.tp=2"):
        resolve_layout(_parallel(dp=3, tp=2), 8)
    with pytest.raises(ConfigError, match=r"^parallel.tp=0 must be at least 1"):  # ran as tp 1 (issue 38)
        resolve_layout(_parallel(tp=0), 8)


def test_the_resume_line_names_every_saved_layout_dimension() -> None:
    """A tp 2 checkpoint was announced as 'saved with dp=1, pp=2' (issue 38)."""
    from pipeflow.checkpoint.saving import saved_layout

    meta = {"step": 4, "dp": 1, "pp": 2, "shard": "none", "world_size": 4}  # as saves write it: tp from the world
    assert saved_layout(meta) == "dp=1, pp=2, tp=2, shard=none (4 processes)"
    assert saved_layout({**meta, "dp": 2, "tp": 1, "shard": "full"}) == "dp=2, pp=2, tp=1, shard=full (4 processes)"
    assert saved_layout({"dp": 1, "pp": 2}) == "dp=1, pp=2, tp=unknown, shard=none"


def test_the_gpt_plan_splits_heads_mlp_and_vocabulary_and_names_what_tp_does_not_divide() -> None:
    spec = build_gpt(vocab_size=64, n_head=4, n_embd=32, n_layer=1)
    layers = spec.build_layers(range(3))
    assert spec.tensor_plan(0, layers[0], 2) == {"wte": "embedding", "": "sequence_out"}
    assert spec.tensor_plan(1, layers[1], 4) == GPT_BLOCK_PLAN
    assert spec.tensor_plan(2, layers[2], 2) == {"ln_f": "norm", "lm_head": "colwise_out"}
    assert set(GPT_BLOCK_PLAN.values()) <= set(TP_STYLES)
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide model.n_head=4"):
        spec.tensor_plan(1, layers[1], 3)
    odd = build_gpt(vocab_size=65, n_head=4, n_embd=32, n_layer=1)
    with pytest.raises(ConfigError, match=r"parallel.tp=2 does not divide model.vocab_size=65"):
        odd.tensor_plan(0, odd.build_layers([0])[0], 2)


def test_a_model_without_a_plan_and_an_unknown_style_are_named() -> None:
    bare = ModelSpec("bare", [LayerSpec("fc", nn.Linear, (4, 4))], loss_fn=lambda o, t: o.sum())
    with pytest.raises(ConfigError, match="model 'bare' has no tensor-parallel plan, so parallel.tp=2"):
        bare.tensor_plan(0, bare.build_layers([0])[0], 2)
    wrong = ModelSpec("wrong", [LayerSpec("fc", nn.Linear, (4, 4))], loss_fn=lambda o, t: o.sum(), tp_plan={"": "cols"})
    with pytest.raises(ConfigError, match=r"style\(s\) \['cols'\] unknown"):
        wrong.tensor_plan(0, wrong.build_layers([0])[0], 2)


class _MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_MLPBlock() for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_from_module_glob_plan_matches_every_layers_own_paths() -> None:
    spec = from_module(_Net, blocks="blocks", after=["head"],
                       tp_plan={"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"})
    block, head = spec.build_layers([1])[0], spec.build_layers([2])[0]
    assert spec.tensor_plan(1, block, 2) == {"blocks.1.fc1": "colwise", "blocks.1.fc2": "rowwise"}
    assert spec.tensor_plan(2, head, 2) == {}  # the head stays whole


def test_sizes_tp_does_not_divide_are_refused_by_module(one_rank_group) -> None:
    from pipeflow.runtime.parallel.tensor_parallel import _check_divisible

    with pytest.raises(ConfigError, match=r"layer 'block.0', module 'mlp.c_fc' \(colwise\): its 5 weight rows are not "
                                          r"divisible by parallel.tp=2"):
        _check_divisible("block.0", "mlp.c_fc", "colwise", nn.Linear(4, 5), 2)
    with pytest.raises(ConfigError, match=r"its 3 weight columns are not divisible"):
        _check_divisible("block.0", "mlp.c_proj", "rowwise", nn.Linear(3, 4), 2)
    with pytest.raises(ConfigError, match=r"its 3 weight rows per third"):
        _check_divisible("block.0", "attn.c_attn", "colwise_qkv", nn.Linear(4, 9), 2)


def test_a_layer_split_over_one_rank_is_itself_and_sequence_parallel_needs_norms(one_rank_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from pipeflow.runtime.parallel.tensor_parallel import parallelize_layer

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    spec = build_gpt(vocab_size=32, n_head=2, n_embd=16, n_layer=1, block_size=8)
    block = spec.build_layers([1], dtype=torch.float64)[0]
    ref = copy.deepcopy(block)
    assert parallelize_layer(spec, 1, block, mesh, sequence_parallel=True) == len(GPT_BLOCK_PLAN)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(block(x), ref(x), rtol=1e-12, atol=1e-12)
    plain = ModelSpec("plain", [LayerSpec("fc", nn.Linear, (4, 4))], loss_fn=lambda o, t: o.sum(),
                      tp_plan={"": "colwise"})
    with pytest.raises(ConfigError, match="no 'norm' or 'sequence_out' entry.*parallel.sequence_parallel=false"):
        parallelize_layer(plain, 0, plain.build_layers([0])[0], mesh, sequence_parallel=True)


def test_ranks_are_named_by_their_dp_pp_tp_coordinates() -> None:
    from pipeflow.observability.trace import chrome_trace
    from pipeflow.runtime.parallel.mesh_order import MeshGrid

    grid = MeshGrid(2, 2, 2)
    assert [grid.coordinates(g) for g in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert grid.label(5) == "rank 5 (dp 1, pp 0, tp 1)"
    assert MeshGrid(2, 2).label(3) == "rank 3 (pipeline rank 1)"  # without tp, as before
    assert MeshGrid(2, 2, 1, ("pp", "dp", "tp")).label(1) == "rank 1 (pipeline rank 0)"  # pp outermost
    per_rank = [((g // 2) % 2, 0.0, 1.0, []) for g in range(4)]  # pp 2 x tp 2
    names = [e["args"]["name"] for e in chrome_trace({0: per_rank}, MeshGrid(1, 2, 2))["traceEvents"]
             if e["name"] == "process_name"]
    assert names == ["rank 0 (dp 0, pp 0, tp 0)", "rank 1 (dp 0, pp 0, tp 1)", "rank 2 (dp 0, pp 1, tp 0)",
                     "rank 3 (dp 0, pp 1, tp 1)"]


def test_sequence_parallel_needs_tp_and_a_sequence_it_splits_evenly(one_rank_group) -> None:
    from pipeflow.config.schema import check_sequence_parallel
    from scale_cases import make_config

    check_sequence_parallel(make_config(1, parallel__tp=2, parallel__sequence_parallel=True))  # seq_len 8
    with pytest.raises(ConfigError, match="needs parallel.tp > 1"):
        check_sequence_parallel(make_config(1, parallel__sequence_parallel=True))
    with pytest.raises(ConfigError, match="data.variable_lengths=true: every sequence length must split"):
        check_sequence_parallel(make_config(1, parallel__tp=2, parallel__sequence_parallel=True,
                                            data__variable_lengths=True))
    with pytest.raises(ConfigError, match="data.seq_len=8 does not split into parallel.tp=3"):
        check_sequence_parallel(make_config(1, parallel__tp=3, parallel__sequence_parallel=True))


def test_a_layer_split_over_tp_ranks_costs_its_share_plus_its_collectives() -> None:
    from dataclasses import replace

    from pipeflow.planning.profile import LayerProfile
    from pipeflow.planning.costs.tensor import TensorLink, split_profile

    p = LayerProfile("block", params=1000, param_bytes=4000, forward_s=1.0, backward_s=2.0, activation_bytes=800,
                     input_grad_s=1.2, weight_grad_s=0.8, output_bytes=100, tp_split=0.8, tp_forward_bytes=200,
                     tp_backward_bytes=200, tp_forward_collectives=2, tp_backward_collectives=2)
    link = TensorLink(bandwidth_Bps=100.0, latency_s=0.01)
    one = split_profile(p, 4, link)
    scale = 0.2 + 0.8 / 4
    comm = 2 * 3 / 4 * 200 / 100.0 + 2 * 0.01  # two ring all-reduces of 100 bytes each over 4 ranks
    assert one.param_bytes == round(4000 * scale) and one.activation_bytes == round(800 * scale)
    assert one.forward_s == pytest.approx(scale + comm) and one.input_grad_s == pytest.approx(1.2 * scale + comm)
    assert one.weight_grad_s == pytest.approx(0.8 * scale) and one.output_bytes == 100
    sp = split_profile(replace(p, tp_norm_bytes=100), 4, link, sequence_parallel=True)
    assert sp.activation_bytes == 200 and sp.output_bytes == 25  # a quarter of the sequence
    assert sp.weight_grad_s == pytest.approx(0.8 * scale + 2 * 3 / 4 * 100 / 100.0 + 0.01)  # norms' grads summed in W
    assert split_profile(p, 1, link) == p


def test_the_profile_counts_what_the_gpt_plan_would_split_and_send() -> None:
    from pipeflow.planning.profile import profile_layers

    spec = build_gpt(vocab_size=64, n_head=4, n_embd=32, n_layer=1, block_size=16)
    embedding, block, head = profile_layers(spec, torch.randint(0, 64, (2, 16)), repeats=1)
    activation = 2 * 16 * 32 * 4  # B x T x C float32
    assert block.tp_forward_bytes == 2 * activation and block.tp_backward_bytes == 2 * activation  # proj, mlp out / c_attn, c_fc in
    assert (block.tp_forward_collectives, block.tp_backward_collectives) == (2, 2)
    assert 0.95 < block.tp_split < 1.0  # every weight but the LayerNorms'
    assert embedding.tp_forward_bytes == activation and embedding.tp_backward_bytes == 0
    assert head.tp_forward_bytes == head.output_bytes // 2  # the logits gathered: half an all-reduce


def test_the_planner_searches_tp_beside_the_schedules(one_rank_group) -> None:
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.planning.search import SearchSpace
    from pipeflow.commands.plan.command import search_tp
    from scale_cases import make_config

    layers = [LayerProfile(f"l{k}", 10**6, 4 * 10**6, 1e-3, 2e-3, 10**6, 1.2e-3, 0.8e-3, 10**5, tp_split=0.9,
                           tp_forward_bytes=2 * 10**5, tp_backward_bytes=2 * 10**5, tp_forward_collectives=2,
                           tp_backward_collectives=2) for k in range(4)]
    cfg = make_config(1, plan__tp_sizes=[1, 2])
    space = SearchSpace(("1f1b",), (4,), (1,))
    result = search_tp(cfg, lambda b: layers, 2, 8, space, None, 0.0, 0.0, None)
    by_tp = {c.tp: c for c in result.candidates}
    assert set(by_tp) == {1, 2} and "parallel.tp=2" in by_tp[2].overrides() and "parallel.tp" not in by_tp[1].overrides()
    assert by_tp[2].peak_bytes < 0.7 * by_tp[1].peak_bytes  # the split weights' share
    assert result.candidates == sorted(result.candidates, key=lambda c: c.step_s)


# --------------------------------------------------------------------------- dp 2 x pp 2 x tp 2: 8 processes
def _hf_case(folder: str, run_root: str) -> dict:
    import test_hf

    return test_hf._trainer_vs_hf(folder, "llama_tied", run_root, 2, "1f1b", 2, parallel__tp=2, parallel__shard="full")


@pytest.fixture(scope="module")
def world8(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import functools

    import moe_cases
    import scale_cases
    from mp_harness import run_cases

    pytest.importorskip("transformers")
    import test_hf

    runs, model = tmp_path_factory.mktemp("runs8"), tmp_path_factory.mktemp("llama_tied")
    test_hf.write_model(str(model), "llama_tied")
    cases = [("gpt-full-1f1b", functools.partial(scale_cases.dp_equivalence, 2, "1f1b", 2, parallel__tp=2,
                                                 parallel__shard="full")),
             ("gpt-full-zbv-sp", functools.partial(scale_cases.dp_equivalence, 2, "zbv", 2, parallel__tp=2,
                                                   parallel__shard="full", parallel__sequence_parallel=True)),
             ("hf-full-1f1b", functools.partial(_hf_case, str(model), str(runs / "hf"))),
             ("gpt-lora-full-zb_h1-sp", functools.partial(  # model.lora: adapters of the fused qkv, rows, columns
                 scale_cases.dp_equivalence, 2, "zb_h1", 2, parallel__tp=2, parallel__shard="full",
                 parallel__sequence_parallel=True, model__lora={"rank": 2, "targets": ["c_attn", "c_proj", "c_fc"]})),
             ("resume-tp-full", functools.partial(scale_cases.resume_across_tp, 2, "full")),
             ("zero-zbv-clipped", functools.partial(scale_cases.dp_equivalence, 2, "zbv", 2, parallel__tp=2,
                                                    parallel__shard="optimizer", optim__grad_clip=0.05)),
             ("resume-tp-zero", functools.partial(scale_cases.resume_across_tp, 2, "optimizer")),
             ("vit", functools.partial(_vision_case, "vit")), ("convnext", functools.partial(_vision_case, "convnext")),
             ("moe-pp2-dp4-ep4", functools.partial(moe_cases.moe_trainer_fit, ep=4, pp=2))]  # issue 45's 8 ranks
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(scale_cases.TMP_ENV, str(runs))
        return run_cases(8, cases)


@pytest.mark.parametrize("name", ["gpt-full-1f1b", "gpt-full-zbv-sp", "hf-full-1f1b", "gpt-lora-full-zb_h1-sp"])
def test_dp2_pp2_tp2_with_fsdp2_equals_the_unsplit_model(world8, name: str) -> None:
    """The 3-D mesh on 8 processes: FSDP2 (parallel.shard=full) over dp around tp-split layers, the
    GPT's fused [q; k; v] included (gathered in its own order), sequence parallel with ZB-V, a
    tied Hugging Face Llama, and LoRA adapters split with the Linear modules they wrap; loss, every
    trained gradient and parameter against the unsplit model (float64)."""
    for rank, result in enumerate(world8[name]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["loss"] <= 1e-9 and v["grad"] <= 1e-9 and v["param"] <= 1e-9, (rank, v)
        if "lora" in name:  # only the adapters handed to the optimizer, each compared
            assert v["params"] == v["params_compared"] > 0, (rank, v)


def test_fsdp2_checkpoints_resume_across_tensor_parallel_degrees(world8) -> None:
    """dp 2 with FSDP2: tp 2 (pp 2) -> tp 1 (pp 4) and tp 1 -> tp 2 with sequence parallelism equal
    the tp 1 run after 6 steps (float64); the GPT's fused [q; k; v] saved whole, loaded by rows."""
    results = world8["resume-tp-full"]
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:1]
    v = results[0].value
    for name in ("tp2_to_tp1", "tp1_to_tp2_sp", "tp2_straight"):
        assert v[f"{name}_same_keys"] and v[f"{name}_shapes"], (name, v)
        assert v[f"{name}_param"] <= 1e-9, (name, v[f"{name}_param"])


def test_zero1_over_tp_shards_equals_the_unsplit_model_and_resumes_across_tp(world8) -> None:
    """parallel.shard=optimizer with tp: ZeRO-1 over each DTensor's local shard (runtime/parallel/zero.py's
    LocalShards), each dp rank owning part of them; ZB-V, clipped, against the unsplit model; and
    its checkpoints (AdamW state saved as DTensors of the parameters' placements) across tp."""
    for rank, result in enumerate(world8["zero-zbv-clipped"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["loss"] <= 1e-9 and v["grad"] <= 1e-9 and v["param"] <= 1e-9, (rank, v)
        assert 0 < v["owned"] < v["params"] and v["norm"] > 0.1, (rank, v)  # sharded; the clip bites
    results = world8["resume-tp-zero"]
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:1]
    v = results[0].value
    for name in ("tp2_to_tp1", "tp1_to_tp2_sp", "tp2_straight"):
        assert v[f"{name}_same_keys"] and v[f"{name}_param"] <= 1e-9, (name, v)


def _vision_case(family: str) -> dict:
    """A small torchvision ViT / ConvNeXt (the zoo's recipe and tp plan) split over tp 2 (pairs of the
    8 ranks), one forward and backward against the unsplit model: loss and every gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipeflow.models import run_layers, zoo
    from pipeflow.runtime.parallel.tensor_parallel import gathered, parallelize_layer
    from test_model_zoo import _images, _small_convnext, _small_vit

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("pairs", "tp"))["tp"]
    constructor, recipe = (_small_vit, zoo.VIT) if family == "vit" else (_small_convnext, zoo.CONVNEXT)
    spec = from_module(constructor, before=recipe.before, blocks=recipe.blocks, after=recipe.after,
                       before_fn=recipe.before_fn, after_fn=recipe.after_fn, init=recipe.init, tp_plan=recipe.tp_plan)
    layers = spec.build_all(dtype=torch.float64)
    reference = copy.deepcopy(layers)
    split = sum(parallelize_layer(spec, i, layer, mesh, False) for i, layer in enumerate(layers))
    x, y = _images(), torch.tensor([1, 7])
    losses = [spec.loss_fn(run_layers(ls, x), y) for ls in (layers, reference)]
    for loss in losses:
        loss.backward()
    grads = [float((gathered(a.grad) - b.grad).abs().max() / b.grad.abs().max().clamp(min=1e-30))
             for la, lb in zip(layers, reference) for a, b in zip(la.parameters(), lb.parameters())]
    return {"split": split, "loss": abs(float(losses[0] - losses[1])), "grad": max(grads)}


@pytest.mark.parametrize("family,modules", [("vit", 6), ("convnext", 10)])
def test_torchvision_vit_and_convnext_split_their_mlps_over_tp(world8, family: str, modules: int) -> None:
    """model=torchvision's ViT and ConvNeXt: each block's MLP split column then row (the zoo's tp
    plan), equal to the unsplit model in float64 (a small model of each, tp 2)."""
    for rank, result in enumerate(world8[family]):
        assert result.error is None, f"rank {rank}: {result.error}"
        assert result.value["split"] == modules, result.value
        assert result.value["loss"] <= 1e-12 and result.value["grad"] <= 1e-9, (rank, result.value)


def test_an_moe_model_on_pp2_dp4_with_ep4_trains_as_the_unsplit_model(world8) -> None:
    """The 8-process MoE case: pp 2 x dp 4 with parallel.ep=4 (one of the 4 experts of each layer
    on each rank), Trainer.fit with bias balancing and aux loss against the unsplit model (float64),
    then resumed with ep 1: every expert back on every rank, loaded by its global index."""
    for rank, result in enumerate(world8["moe-pp2-dp4-ep4"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["experts_held"] == 1 and v["experts_after_resume"] == 4 and v["resumed_at"] == 3, (rank, v)
        assert max(v["loss"], v["param"], v["resumed"]) <= 1e-9, (rank, v)
