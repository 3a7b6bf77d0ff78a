"""train.compile: compiled layers (torch.compile, regional) for every schedule, the split-backward
ones computing each half of a compiled backward once (pipeflow/runtime/compiled_backward.py).

In-process: the split itself (B then W = eager, each half run once), activation checkpointing,
bf16 autocast, a graph break falling back to eager by name, refused modes, the torch-version
fallback, a compiled profile, one inductor smoke test.  One 2-process gloo world: the real
Trainer with train.compile=true (aot_eager: the same graphs without code generation, quick to
compile on 2 cores) for each schedule family against the unsplit eager model in float64, with
variable lengths (no recompiles), bf16, tied weights and a from_module model; dp x shard modes
run in tests/test_scale.py's 4-process world, model=hf in tests/test_hf.py's.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

from mp_harness import CaseResult, run_cases, selected_cases
from pipeflow.errors import CompileFallbackWarning, ConfigError
from pipeflow.runtime import compiled_backward
from pipeflow.runtime.compile import CompileOptions, check_options, compile_layer, compile_stage_layers
from pipeflow.runtime.stage import Stage

F64 = torch.float64
TOLERANCE = 1e-9  # float64, as every schedule's equivalence test


class Block(nn.Module):
    """A pre-norm MLP block with a residual: weights in LayerNorm and two Linears."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class Breaks(Block):
    """A block Dynamo cannot capture whole (a data-dependent branch on a tensor's value)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 1e30:  # a host read inside the graph: a graph break
            return x
        return super().forward(x)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _split_run(layers: list[nn.Module], dtype: torch.dtype = F64, checkpoint_every: int = 0,
               compute_dtype: torch.dtype | None = None, m: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """B for every micro-batch, then W in reverse order, then one full backward: (parameter grads,
    input grads)."""
    stage = Stage(0, 1, layers, _mse, compute_dtype=compute_dtype, checkpoint_every=checkpoint_every)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 8, generator=gen, dtype=dtype) for _ in range(m + 1)]
    ys = [torch.randn(2, 5, 8, generator=gen, dtype=dtype) for _ in range(m + 1)]
    for i in range(m):
        stage.forward(i, (xs[i].requires_grad_(),), ys[i])
    inputs = [stage.backward(i, None, weights=False)[0] for i in range(m)]
    assert all(p.grad is None for p in stage.parameters())  # B left every weight gradient to W
    for i in reversed(range(m)):
        stage.backward_weight(i)
    stage.forward(m, (xs[m].requires_grad_(),), ys[m])
    inputs.append(stage.backward(m, None)[0])
    return [p.grad for p in stage.parameters()], inputs


def _compiled(layers: list[nn.Module], backend: str = "aot_eager", split: bool = True) -> list[nn.Module]:
    for k, layer in enumerate(layers):
        assert compile_layer(layer, f"block.{k}", CompileOptions(backend=backend), split) is not None
    return layers


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


def _halves() -> dict[str, int]:
    return dict(compiled_backward.STATS)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: compiled_backward.STATS[k] - v for k, v in before.items()}


def test_split_compiled_backward_runs_each_half_once_and_equals_eager() -> None:
    torch.manual_seed(0)
    eager = [Block().to(F64) for _ in range(3)]
    compiled = _compiled(copy.deepcopy(eager))
    before = _halves()
    got = _split_run(compiled)
    ran = _delta(before)
    want = _split_run(eager)
    assert _worst(got[0], want[0]) <= 1e-14 and _worst(got[1], want[1]) <= 1e-14
    # 3 split backwards (B, W) and 1 full, over 3 layers: every half once per layer and micro-batch
    assert ran == {"input_half": 12, "weight_half": 12, "whole": 0}, ran


def test_a_compiled_split_backward_never_runs_the_weight_half_in_b() -> None:
    layer = _compiled([Block().to(F64)])[0]
    x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
    out = layer(x)
    before = _halves()
    with compiled_backward.deferring_weight_grads():
        (gx,) = torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)
    assert _delta(before) == {"input_half": 1, "weight_half": 0, "whole": 0}
    grads = torch.autograd.grad(out, list(layer.parameters()), torch.ones_like(out))
    assert _delta(before) == {"input_half": 1, "weight_half": 1, "whole": 0}
    ref = Block().to(F64)
    ref.load_state_dict(layer.state_dict())
    x2 = x.detach().requires_grad_()
    out2 = ref(x2)
    want = torch.autograd.grad(out2, [x2, *ref.parameters()], torch.ones_like(out2))
    assert _worst([gx, *grads], list(want)) <= 1e-14


def test_split_compiled_backward_with_activation_checkpointing_and_bf16_autocast() -> None:
    torch.manual_seed(1)
    eager = [Block().to(F64) for _ in range(2)]
    got, want = _split_run(_compiled(copy.deepcopy(eager)), checkpoint_every=1), _split_run(eager, checkpoint_every=1)
    assert _worst(got[0], want[0]) <= 1e-14 and _worst(got[1], want[1]) <= 1e-14
    eager32 = [Block() for _ in range(2)]
    got = _split_run(_compiled(copy.deepcopy(eager32)), dtype=torch.float32, compute_dtype=torch.bfloat16)
    want = _split_run(eager32, dtype=torch.float32, compute_dtype=torch.bfloat16)
    assert _worst(got[0], want[0]) <= 2e-2 and _worst(got[1], want[1]) <= 2e-2


def test_a_layer_that_cannot_be_compiled_whole_runs_eager_with_a_warning_naming_it() -> None:
    layer = Breaks().to(F64)
    ref = copy.deepcopy(layer)
    wrapper = compile_layer(layer, "block.7", CompileOptions(backend="aot_eager"), split_backward=True)
    x = torch.randn(2, 5, 8, dtype=F64)
    with pytest.warns(CompileFallbackWarning, match=r"layer 'block\.7' runs eager"):
        out = layer(x)
    assert wrapper.fallback is not None and "Error" in wrapper.fallback
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls are quietly eager
        layer(x)


def test_cuda_graph_modes_and_unknown_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="reduce-overhead is refused: CUDA graph trees"):
        check_options("reduce-overhead", "inductor")
    with pytest.raises(ConfigError, match="max-autotune-no-cudagraphs"):
        check_options("max-autotune", "inductor")
    with pytest.raises(ConfigError, match="not a compile mode"):
        check_options("fast", "inductor")
    with pytest.raises(ConfigError, match="compile_backend='cudagraphs' is not supported"):
        check_options("default", "cudagraphs")
    check_options("max-autotune-no-cudagraphs", "aot_eager")


def test_an_old_torch_leaves_split_stages_eager_with_one_warning(monkeypatch) -> None:
    assert compiled_backward.split_unavailable() is None  # this torch splits
    assert "older than" in compiled_backward.split_unavailable("2.4.1+cu121")
    with monkeypatch.context() as patch:  # a torch that has the version but not the names
        patch.delattr(torch._C, "_current_autograd_node")
        assert "lacks torch._C._current_autograd_node" in compiled_backward.split_unavailable()
    monkeypatch.setattr(compiled_backward, "split_unavailable", lambda version=None: "torch 2.4 is older than 2.6")
    split, whole = Stage(0, 2, [Block()], split_backward=True), Stage(1, 2, [Block()], split_backward=False)
    with pytest.warns(CompileFallbackWarning, match="split their backward .* run eager: torch 2.4"):
        units = {0: [("a", split.module[0])], 1: [("b", whole.module[0])]}
        wrappers = compile_stage_layers({0: split, 1: whole}, units, CompileOptions(backend="aot_eager"))
    assert [w.name for w in wrappers] == ["b"]
    assert "forward" not in split.module[0].__dict__


def test_a_compiled_profile_times_both_halves() -> None:
    from pipeflow.models.spec import LayerSpec, ModelSpec
    from pipeflow.planning.profile import profile_layers

    spec = ModelSpec("blocks", [LayerSpec(f"block.{k}", Block) for k in range(2)], _mse)
    before = _halves()
    profiles = profile_layers(spec, torch.randn(2, 5, 8), repeats=2, split_backward=True,
                              compiled=CompileOptions(backend="aot_eager"))
    ran = _delta(before)
    assert all(p.forward_s > 0 and p.weight_grad_s > 0 for p in profiles)
    assert profiles[1].input_grad_s > 0  # the first layer's input needs no gradient
    assert ran["input_half"] == ran["weight_half"] > 0, ran


def test_inductor_compiles_the_two_halves(tmp_path, monkeypatch) -> None:
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(2)
    eager = [Block()]
    # scalar C++ kernels: the same graphs and halves, compiled without the vector headers (half the time on 2 cores)
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        got = _split_run(_compiled(copy.deepcopy(eager), backend="inductor"), dtype=torch.float32, m=1)
    want = _split_run(eager, dtype=torch.float32, m=1)
    assert _worst(got[0], want[0]) <= 1e-5 and _worst(got[1], want[1]) <= 1e-5


# --------------------------------------------------------------------------- the Trainer, 2 processes
COMPILE = {"train__compile": True, "train__compile_backend": "aot_eager"}
SCHEDULES = {  # schedule -> micro-batches
    "1f1b": 4, "interleaved_1f1b": 4, "zb_h1": 4, "zb_h2": 4, "zbv": 4, "v_half": 4, "v_min": 4,
    "interleaved_zb": 4, "dualpipev": 4,
}


def _trainer_case(schedule: str, m: int, steps: int = 3, **overrides) -> dict:
    """scale_cases.dp_equivalence compiled, with what the compile did on this rank."""
    import scale_cases

    torch._dynamo.config.cache_size_limit = 64  # one process compiles every case's graphs
    before = _halves()
    worst = scale_cases.dp_equivalence(1, schedule, m, steps, **COMPILE, **overrides)
    return {**worst, "halves": _delta(before)}


def _from_module_case(schedule: str = "zb_h1", m: int = 4) -> dict:
    """A from_module model (test_from_module's LongSkip, traced at two points) compiled and
    pipelined on 2 ranks against the module, one step."""
    import torch.distributed as dist

    from pipeflow.models import from_module
    from pipeflow.runtime.pipeline import Pipeline
    from pipeflow.runtime.stage import as_tuple, build_stages
    from pipeflow.runtime.transport import P2PComm
    from pipeflow.schedules import build_schedule
    from pipeline_cases import rel_diff
    from test_from_module import LongSkip, _merged
    from toy_models import random_batch

    spec = from_module(LongSkip, split_points=["a", "out"])
    plan = build_schedule(schedule, 2, m)
    ranges = [range(0, 2), range(2, len(spec.layers))]
    stages = build_stages(spec, ranges, plan.stages_of(dist.get_rank()), dtype=F64)
    comm = P2PComm(None, torch.device("cpu"), timeout_s=60.0)
    pipe = Pipeline(stages, plan, comm)
    units = {s: [(spec.layers[i].name, layer) for i, layer in zip(ranges[s], stage.module)]
             for s, stage in stages.items()}
    wrappers = compile_stage_layers(stages, units, CompileOptions(backend="aot_eager"))
    module = LongSkip().to(F64)
    module.load_state_dict(_merged(spec.build_all(dtype=F64)))
    x, y = random_batch("mlp", 8, seed=1)
    loss_ref = spec.loss_fn(module(x.to(F64)), y)
    loss_ref.backward()
    inputs = [as_tuple(t) for t in x.to(F64).chunk(m)] if 0 in stages else None
    before = _halves()
    loss = pipe.run(inputs, list(y.chunk(m)) if 1 in stages else None)
    grads = [rel_diff(p.grad, module.get_parameter(name).grad)
             for stage in stages.values() for layer in stage.module for name, p in layer.named_parameters()]
    return {"loss": rel_diff(loss, loss_ref.detach()) if loss is not None else 0.0, "grad": max(grads),
            "eager": [w.name for w in wrappers if w.fallback], "compiled": len(wrappers), "halves": _delta(before)}


def _cases() -> list[tuple[str, object]]:
    cases = [(name, functools.partial(_trainer_case, name, m)) for name, m in SCHEDULES.items()]
    return cases + [
        ("zbv-actckpt", functools.partial(_trainer_case, "zbv", 4, pipeline__checkpoint_activations=True)),
        ("zb_h1-variable-lengths", functools.partial(_trainer_case, "zb_h1", 4, steps=4, data__variable_lengths=True,
                                                     data__min_seq_len=3)),
        ("1f1b-bf16", functools.partial(_trainer_case, "1f1b", 4, steps=1, train__precision="bf16",
                                        train__param_dtype="float32")),
        ("from-module", _from_module_case),
    ]


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[CaseResult]]:
    import scale_cases

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(scale_cases.TMP_ENV, str(tmp_path_factory.mktemp("runs")))
        return run_cases(2, selected_cases(request, _cases()))


def _values(results: list[CaseResult]) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


SPLIT = {"zb_h1", "zb_h2", "zbv", "v_half", "v_min", "interleaved_zb", "dualpipev"}


@pytest.mark.parametrize("name", list(SCHEDULES) + ["zbv-actckpt", "zb_h1-variable-lengths"])
def test_compiled_trainer_equals_the_unsplit_eager_model(world, name: str) -> None:
    for rank, v in enumerate(_values(world[name])):
        assert v["compile"]["layers"] > 0 and v["compile"]["eager_layers"] == {}, v
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, f"{name} rank {rank}: {key} differs by {v[key]:.3e}"
        halves = v["halves"]
        if name.split("-")[0] in SPLIT:  # the compiled backward was split: its halves ran equally often
            assert halves["input_half"] == halves["weight_half"] > 0, halves
        else:
            assert halves["input_half"] == halves["weight_half"] == 0, halves


def test_variable_lengths_reuse_one_dynamic_graph(world) -> None:
    for v in _values(world["zb_h1-variable-lengths"]):
        assert v["compile"]["recompiles"] == 0, v
        assert len(v["lengths"]) > 1, v  # the micro-batches really differed


def test_compiled_bf16_gradients_agree_with_fp32_as_eager_bf16_does(world) -> None:
    for v in _values(world["1f1b-bf16"]):  # tests/test_scale.py's bound for eager bf16
        assert v["compile"]["eager_layers"] == {}, v
        assert 0 < v["grad"] < 0.05 and v["loss"] < 0.05, v


def test_a_compiled_from_module_model_equals_the_module(world) -> None:
    for v in _values(world["from-module"]):
        assert v["compiled"] > 0 and v["eager"] == [], v
        assert v["loss"] <= TOLERANCE and v["grad"] <= TOLERANCE, v


def test_compile_options_mark_the_dimensions_micro_batches_differ_in() -> None:
    from omegaconf import OmegaConf

    from pipeflow.run.compile_phase import compile_options
    from pipeflow.config.schema import Config, MarkovDataConfig

    cfg = OmegaConf.structured(Config(data=MarkovDataConfig()))
    assert compile_options(cfg, 4) is None  # train.compile=false: eager
    cfg.train.update(compile=True, compile_backend="aot_eager")
    assert compile_options(cfg, 4) == CompileOptions(backend="aot_eager", dynamic_dims=())
    cfg.data.variable_lengths = True
    assert compile_options(cfg, 4).dynamic_dims == (1,)
    cfg.data.batch_size = 30  # 30 rows do not split into 4 equal micro-batches
    assert compile_options(cfg, 4).dynamic_dims == (0, 1)
    assert compile_options(cfg, 4).no_split is None
    cfg.parallel.update(tp=2)  # split-backward stages stay eager, named
    assert "parallel.tp=2: the compiled B/W split" in compile_options(cfg, 4).no_split


def test_a_compiled_layer_keeps_its_state_dict_names() -> None:
    layer = Block()
    names = list(layer.state_dict())
    compile_layer(layer, "block.0", CompileOptions(backend="aot_eager"), split_backward=False)
    assert list(layer.state_dict()) == names  # checkpoints and export see the same keys


def test_b_keeps_no_input_gradient_for_w_when_the_compiled_region_is_the_whole_layer() -> None:
    class Scaled(nn.Module):  # a parameter outside the compiled block: W must reach it through the block
        def __init__(self) -> None:
            super().__init__()
            self.scale, self.block = nn.Parameter(torch.tensor(1.5, dtype=F64)), Block().to(F64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x * self.scale)

    whole = _compiled([Block().to(F64)])[0]
    outer = Scaled()
    ref = copy.deepcopy(outer)
    units = {0: [("scaled", outer.block)]}
    stage = Stage(0, 1, [outer], _mse)
    assert compile_stage_layers({0: stage}, units, CompileOptions(backend="aot_eager"))[0].whole_layer is False
    for layer, keeps in ((whole, False), (outer, True)):
        x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
        out = layer(x)
        node = out.grad_fn
        with compiled_backward.deferring_weight_grads():
            torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)
        pending = getattr(node, compiled_backward.PENDING_ATTR)
        kept = [g for _, g in pending.args[0]]  # the input gradients kept from B to W
        held = sum(g.untyped_storage().nbytes() for g in kept)
        whole = x.numel() * x.element_size()
        assert held >= whole if keeps else held <= 8 * len(kept), held  # else expanded zero scalars
    grads = torch.autograd.grad(out, list(outer.parameters()), torch.ones_like(out))
    x2 = x.detach().requires_grad_()
    out2 = ref(x2)
    want = torch.autograd.grad(out2, list(ref.parameters()), torch.ones_like(out2))
    assert _worst(list(grads), list(want)) <= 1e-14  # the outer scale's gradient came through the block
