"""pipeflow.models.from_module: an existing nn.Module as pipeline layers, in one process.

Each form's layers, chained, equal the module's own forward with the same weights (the
multi-rank float64 equivalence is in test_pipeline_equivalence.py); weights come from each
layer's seed and its modules' own init, or from a state dict file of the unsplit model.
"""
from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models import from_module, run_layers
from pipeflow.models.traced import UntraceableModelError
from pipeflow.runtime.tied import tie_in_place
from toy_models import SEQUENTIAL_GROUPS, SKIP_SPLIT_POINTS, DataDependent, SizeAcross, SkipNet, mlp_sequential

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.your_module import GPT, embed, split_gpt  # noqa: E402

F64 = torch.float64
GPT_SIZES = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)


def _layers(spec, dtype=F64):
    layers = spec.build_all(dtype=dtype)
    tie_in_place(spec, dict(enumerate(layers)))
    return layers


def _merged(layers) -> dict:
    merged = {}
    for layer in layers:
        merged.update(layer.state_dict())
    return merged


def _same_as_module(layers, module: nn.Module, x) -> None:
    """The chained layers equal `module` loaded with their weights (state dict keys are its own)."""
    module = module.to(F64)
    merged = _merged(layers)
    assert set(merged) == set(module.state_dict())
    module.load_state_dict(merged)
    torch.testing.assert_close(run_layers(layers, x), module(x), rtol=0, atol=0)


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


# ----------------------------------------------------------------- nn.Sequential


def test_a_sequential_is_a_layer_per_child_or_per_group() -> None:
    spec = from_module(mlp_sequential)
    assert spec.layer_names() == [str(k) for k in range(7)]
    _same_as_module(_layers(spec), mlp_sequential(), _x(3, 32))
    grouped = from_module(mlp_sequential, groups=SEQUENTIAL_GROUPS)
    assert grouped.layer_names() == ["0+1", "2+3", "4+5", "6"]
    _same_as_module(_layers(grouped), mlp_sequential(), _x(3, 32))
    with pytest.raises(ConfigError, match=r"must list every child of the nn.Sequential once, in order"):
        from_module(mlp_sequential, groups=[["0", "2"], ["1", "3", "4", "5", "6"]])


def test_a_built_module_keeps_its_weights() -> None:
    model = mlp_sequential().to(F64)
    layers = from_module(model).build_all(dtype=F64)
    x = _x(3, 32)
    torch.testing.assert_close(run_layers(layers, x), model(x), rtol=0, atol=0)


def test_weights_come_from_each_layers_seed() -> None:
    a, b = from_module(mlp_sequential).build_layers([2])[0], from_module(mlp_sequential).build_layers([2])[0]
    other = from_module(mlp_sequential, seed=1).build_layers([2])[0]
    assert torch.equal(a.get_parameter("2.weight"), b.get_parameter("2.weight"))
    assert not torch.equal(a.get_parameter("2.weight"), other.get_parameter("2.weight"))
    assert a.get_parameter("2.weight").abs().sum() > 0  # nn.Linear's own reset_parameters ran


def test_each_form_has_its_own_entry_point_giving_from_modules_spec() -> None:
    """Issue 49: from_sequential, from_blocks and from_traced take only their form's options and
    give what from_module gives for it; each refuses a model it cannot split, naming another."""
    from pipeflow.models import from_blocks, from_sequential, from_traced

    grouped = from_sequential(mlp_sequential, groups=SEQUENTIAL_GROUPS, seed=3)
    assert grouped.layer_names() == from_module(mlp_sequential, groups=SEQUENTIAL_GROUPS).layer_names()
    torch.testing.assert_close(run_layers(_layers(grouped), _x(3, 32)),
                               run_layers(_layers(from_module(mlp_sequential, groups=SEQUENTIAL_GROUPS, seed=3)), _x(3, 32)))
    gpt = functools.partial(GPT, **GPT_SIZES)
    blocks = from_blocks(gpt, "blocks", before=["tok_emb", "pos_emb"], before_fn=embed, after=["ln_f", "head"])
    assert blocks.layer_names() == ["before", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "after"]
    assert blocks.tied == {"tok_emb.weight": [("before", "tok_emb.weight"), ("after", "head.weight")]}
    traced_spec = from_traced(SkipNet, SKIP_SPLIT_POINTS, name="skip")
    assert traced_spec.name == "skip" and len(traced_spec.layers) == len(SKIP_SPLIT_POINTS) + 1
    with pytest.raises(ConfigError, match=r"from_sequential needs an nn.Sequential; got SkipNet"):
        from_sequential(SkipNet)


def test_a_model_that_is_not_a_sequential_needs_a_form() -> None:
    with pytest.raises(ConfigError, match=r"say how to split SkipNet: before=\[...\], blocks="):
        from_module(SkipNet)


# ----------------------------------------------------------------- the blocks form


def test_blocks_form_equals_the_module_with_the_head_tied() -> None:
    spec = split_gpt(**GPT_SIZES)
    assert spec.layer_names() == ["before", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "after"]
    assert spec.tied == {"tok_emb.weight": [("before", "tok_emb.weight"), ("after", "head.weight")]}
    layers = _layers(spec)
    assert layers[-1].get_parameter("head.weight") is layers[0].get_parameter("tok_emb.weight")
    x = torch.randint(64, (3, 16))
    _same_as_module(layers, GPT(**GPT_SIZES), x)


def test_the_init_hook_repeats_the_constructors_own_init() -> None:
    """GPT-2's init by name (N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)) runs
    per layer; without the hook each module keeps its own reset_parameters init."""
    (block,) = split_gpt(**GPT_SIZES, seed=3).build_layers([1])
    c_proj = block.get_submodule("blocks.0.c_proj")
    assert abs(c_proj.weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.002
    assert torch.equal(c_proj.bias, torch.zeros_like(c_proj.bias))
    (plain,) = from_module(functools.partial(GPT, **GPT_SIZES), before=["tok_emb", "pos_emb"], blocks="blocks",
                           after=["ln_f", "head"], before_fn=lambda m, i: m.tok_emb(i)).build_layers([1])
    assert not torch.equal(plain.get_submodule("blocks.0.c_proj").bias, torch.zeros(16))


def test_blocks_form_errors_say_what_to_add() -> None:
    gpt = functools.partial(GPT, **GPT_SIZES)
    with pytest.raises(ConfigError, match=r"GPT.pos_emb.weight belongs to no layer: add the path"):
        from_module(gpt, before=["tok_emb"], blocks="blocks", after=["ln_f", "head"])
    with pytest.raises(ConfigError, match=r"has no submodule, parameter or buffer 'ln_final'"):
        from_module(gpt, before=["tok_emb", "pos_emb"], blocks="blocks", after=["ln_final", "head"])
    with pytest.raises(ConfigError, match=r"GPT.ln_f.weight is held by several layers"):
        from_module(gpt, before=["tok_emb", "pos_emb", "ln_f"], blocks="blocks", after=["ln_f", "head"])
    with pytest.raises(ConfigError, match=r"blocks='tok_emb' must name a module whose children are the blocks"):
        from_module(gpt, before=["pos_emb"], blocks="tok_emb", after=[])


class WithBuffer(nn.Module):
    """A buffer computed in __init__ (no reset_parameters recomputes it) and a plain parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Scaled(k) for k in range(2))


class Scaled(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.arange(4.0) + k, persistent=False)
        self.gain = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.scale * self.gain


def test_buffers_made_by_the_constructor_are_kept_parameters_without_init_start_at_zero() -> None:
    spec = from_module(WithBuffer, before=["inp"], blocks="blocks")
    layers = spec.build_all()
    assert torch.equal(layers[2].get_buffer("blocks.1.scale"), torch.arange(4.0) + 1)
    assert torch.equal(layers[1].get_parameter("blocks.0.gain"), torch.zeros(4))  # documented: init hook


# ----------------------------------------------------------------- the traced form


def test_traced_form_with_a_skip_across_split_points_equals_the_module() -> None:
    spec = from_module(SkipNet, split_points=SKIP_SPLIT_POINTS)
    assert len(spec) == 4
    layers = _layers(spec)
    x = _x(3, 32)
    _same_as_module(layers, SkipNet(), x)
    assert isinstance(run_layers(layers[:2], x), tuple)  # the skip travels beside the activation


def test_traced_form_ties_a_shared_parameter() -> None:
    spec = from_module(functools.partial(GPT, **GPT_SIZES), split_points=["blocks.2", "ln_f"])
    assert [m[0] for m in spec.tied["tok_emb.weight"]] == ["part0", "part2"]
    _same_as_module(_layers(spec), GPT(**GPT_SIZES), torch.randint(64, (2, 16)))


def test_untraceable_forward_names_the_construct_and_the_other_forms() -> None:
    with pytest.raises(UntraceableModelError) as err:
        from_module(DataDependent, split_points=["b"])
    text = str(err.value)
    assert "toy_models.py" in text and "symbolically traced variables cannot be used as inputs to control flow" in text
    assert "blocks form" in text and "nn.Sequential" in text
    with pytest.raises(ConfigError, match=r"split point 'nowhere' is not called"):
        from_module(SkipNet, split_points=["nowhere"])
    with pytest.raises(ConfigError, match=r"list split_points in forward order"):
        from_module(SkipNet, split_points=["b2", "b1"])


def test_a_non_tensor_crossing_a_split_point_is_refused_by_name() -> None:
    layers = from_module(SizeAcross, split_points=["b"]).build_all()
    with pytest.raises(ConfigError, match=r"traced value 'size' \(a int, not a tensor\) is made before split point"):
        run_layers(layers, torch.randn(2, 4))


# ----------------------------------------------------------------- init_from


def test_init_from_reproduces_the_unsplit_model(tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = GPT(**GPT_SIZES)
    path = tmp_path / "gpt.pt"
    torch.save(model.state_dict(), path)
    spec = from_module(functools.partial(GPT, **GPT_SIZES), before=["tok_emb", "pos_emb"], blocks="blocks",
                       after=["ln_f", "head"], before_fn=embed, init_from=str(path))
    layers = _layers(spec)
    x = torch.randint(64, (3, 16))
    torch.testing.assert_close(run_layers(layers, x), model.to(F64)(x), rtol=0, atol=0)


def test_init_from_reads_only_the_layers_own_tensors(tmp_path: Path) -> None:
    state = GPT(**GPT_SIZES).state_dict()
    del state["blocks.3.c_fc.weight"]
    torch.save(state, tmp_path / "partial.pt")
    spec = from_module(functools.partial(GPT, **GPT_SIZES), before=["tok_emb", "pos_emb"], blocks="blocks",
                       after=["ln_f", "head"], before_fn=embed,
                       init_from=str(tmp_path / "partial.pt"))
    spec.build_layers([0, 1, 2, 3, 5])  # the layers that do not need the missing tensor
    with pytest.raises(ConfigError, match=r"layer 'blocks.3': model.init_from=.* has no 'blocks.3.c_fc.weight'"):
        spec.build_layers([4])
    with pytest.raises(ConfigError, match=r"model.init_from='nowhere.pt' does not exist"):
        from_module(mlp_sequential, init_from="nowhere.pt").build_layers([0])


def test_a_meta_device_pass_counts_parameters_without_materialising() -> None:
    spec = from_module(mlp_sequential)
    with torch.device("meta"):  # as planning.profile.count_layer_params builds a layer
        layer = spec.layers[0].build()
    assert layer.get_parameter("0.weight").device.type == "meta"


def test_init_from_reads_a_distributed_checkpoint_directory(tmp_path: Path) -> None:
    """model.init_from=<torch.distributed.checkpoint directory>: each layer loads its own keys."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(11)
    model = GPT(**GPT_SIZES)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    spec = from_module(functools.partial(GPT, **GPT_SIZES), before=["tok_emb", "pos_emb"], blocks="blocks",
                       after=["ln_f", "head"], before_fn=embed,
                       init_from=str(tmp_path / "dcp"))
    x = torch.randint(64, (3, 16))
    torch.testing.assert_close(run_layers(_layers(spec), x), model.to(F64)(x), rtol=0, atol=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"is a directory but not a torch.distributed.checkpoint"):
        from_module(mlp_sequential, init_from=str(tmp_path / "empty")).build_layers([0])


class SizedByABuffer(nn.Module):
    """A constructor that reads a tensor's value (.item()): it cannot run on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("width", torch.tensor(3))
        self.blocks = nn.ModuleList([nn.Linear(int(self.width.item()), 3), nn.Linear(3, 2)])


def test_a_constructor_that_needs_values_runs_with_real_buffers() -> None:
    spec = from_module(SizedByABuffer, before=["width"], before_fn=lambda m, x: x * m.width, blocks="blocks")
    layers = spec.build_all()
    assert torch.equal(layers[0].get_buffer("width"), torch.tensor(3))
    assert run_layers(layers, torch.ones(1, 3)).shape == (1, 2)


def test_a_meta_module_whose_buffers_cannot_be_recomputed_is_refused() -> None:
    with torch.device("meta"):
        model = WithBuffer()
    spec = from_module(model, before=["inp"], blocks="blocks")
    spec.build_layers([0])  # nn.Linear resets itself
    with pytest.raises(ConfigError, match=r"\['blocks.0.scale'\] were made on the meta device.*pass the model's constructor"):
        spec.build_layers([1])


# ----------------------------------------------------------------- the traced form in the pipeline (2 ranks)
# Forwards that reuse an activation after a later layer consumed it. Split at every child, one and two
# cut points (the three parts on the two stages both ways), pipelined on the test world's 2 gloo ranks
# with 1F1B and a split backward (ZB-H1): loss and every gradient equal the unsplit module's.

HIDDEN, CLASSES = 16, 10


class LongSkip(nn.Module):
    """h2 = b(a(h0)) + h0: the skip's source is consumed by `a` before it travels on."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b = nn.Linear(32, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.nn.functional.gelu(self.inp(x))
        h1 = torch.tanh(self.a(h0))
        return self.out(torch.tanh(self.b(h1)) + h0)


class Gate(nn.Module):
    """c(b(h1)) * sigmoid(h1): h1 gates what a later layer made of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.c, self.d = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.a(x)
        return self.d(self.c(self.b(h1)) * torch.sigmoid(h1))


class ConcatFirst(nn.Module):
    """out(cat([m2(relu(m1(h0))), h0])): the first layer's output joins the last one's."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.m1, self.m2 = nn.Linear(32, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.first(x)
        return self.out(torch.cat([self.m2(torch.relu(self.m1(h0))), h0], dim=-1))


class UNet(nn.Module):
    """Nested skips, U-Net style: e1 joins the decoder by a sum, e0 (two layers further out) by a product."""

    def __init__(self) -> None:
        super().__init__()
        self.enc0, self.enc1 = nn.Linear(32, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.mid, self.dec1 = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e0 = torch.tanh(self.enc0(x))
        e1 = torch.tanh(self.enc1(e0))
        d1 = torch.tanh(self.dec1(torch.tanh(self.mid(e1)) + e1))
        return self.out(d1 * e0)


REUSING = {"long_skip": LongSkip, "gate": Gate, "concat_first": ConcatFirst, "unet": UNet}
PIPELINE_SCHEDULES = ("1f1b", "zb_h1")  # a full backward; B and W split


def every_split(model: type[nn.Module]) -> list[tuple[list[str], int]]:
    """(split points, layers on stage 0) for every one and two cut points at `model`'s children
    (declared in forward order); with two, the three parts go 1 + 2 and 2 + 1 on the two stages."""
    children = [name for name, _ in model().named_children()][1:]
    one = [([c], 1) for c in children]
    two = [([a, b], k) for i, a in enumerate(children) for b in children[i + 1:] for k in (1, 2)]
    return one + two


def _split_cases() -> list[tuple[str, object]]:
    cases = []
    for model, cls in REUSING.items():
        for (points, k), schedule in itertools.product(every_split(cls), PIPELINE_SCHEDULES):
            name = f"{model}-{'+'.join(points)}-{k}-{schedule}"
            case = functools.partial(pipelined_like_module, model, points, k, schedule)
            cases.append((name, functools.partial(_unless_one_failed, name, case)))
    return cases


_FAILED: list[str] = []  # in a world's process: its first failed case (the ranks are out of step after it)


def _unless_one_failed(name: str, case: functools.partial) -> object:
    """Run `case`, unless an earlier case failed on this rank: then its peer may still wait for a
    message of that case, so this rank runs nothing more and names the first failure."""
    if _FAILED:
        raise RuntimeError(f"not run: case {_FAILED[0]} failed first on this rank")
    try:
        return case()
    except Exception:
        _FAILED.append(name)
        raise


def pipelined_like_module(model: str, points: list[str], first: int, schedule: str, m: int = 4) -> dict[str, float]:
    """One training step of `model` traced at `points` (stage 0 holding the first `first` parts) on
    this rank, beside the unsplit module on the same batch: the worst relative loss and gradient
    differences, and how many of each this rank compared."""
    import torch.distributed as dist

    from pipeflow.runtime.pipeline import Pipeline
    from pipeflow.runtime.stage import as_tuple, build_stages
    from pipeflow.runtime.transport import P2PComm
    from pipeflow.schedules import build_schedule
    from pipeline_cases import rel_diff
    from toy_models import random_batch

    spec = from_module(REUSING[model], split_points=points)
    plan = build_schedule(schedule, 2, m)
    ranges = [range(0, first), range(first, len(spec.layers))]
    stages = build_stages(spec, ranges, plan.stages_of(dist.get_rank()), dtype=F64)
    comm = P2PComm(None, torch.device("cpu"), timeout_s=20.0)
    pipe = Pipeline(stages, plan, comm)
    held: list[int] = []  # layer outputs kept by a stage right after each forward
    for stage in stages.values():
        stage.forward_hooks.append(lambda st, i, out: held.append(len(st._boundaries)) or out)
    module = REUSING[model]().to(F64)
    module.load_state_dict(_merged(spec.build_all(dtype=F64)))
    x, y = random_batch("mlp", 8, seed=1)
    loss_ref = spec.loss_fn(module(x), y)
    loss_ref.backward()
    inputs = [as_tuple(t) for t in x.chunk(m)] if 0 in stages else None
    loss = pipe.run(inputs, list(y.chunk(m)) if 1 in stages else None)
    grads = [rel_diff(p.grad, module.get_parameter(name).grad)
             for stage in stages.values() for layer in stage.module for name, p in layer.named_parameters()]
    return {"loss": rel_diff(loss, loss_ref.detach()) if loss is not None else 0.0, "grad": max(grads),
            "losses": int(loss is not None), "grads": len(grads), "boundaries_held": max(held)}


@pytest.fixture(scope="module")
def world() -> dict:
    from mp_harness import run_cases

    return run_cases(2, _split_cases())


@pytest.mark.parametrize("name", [name for name, _ in _split_cases()])
def test_traced_split_reusing_an_activation_equals_the_module_pipelined(world, name: str) -> None:
    """Every split point of a long skip, a gate, a concat with the first layer's output and nested
    U-Net skips, through the real pipeline: before the fix the first backward failed on stage 0
    (``mat2 must be a matrix``: a sent output's storage was freed though the stage had saved it).
    A stage under 1F1B keeps no layer outputs from forward to backward; under ZB-H1 it does."""
    results = world[name]
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    values = [res.value for res in results]
    assert sum(v["losses"] for v in values) == 1 and all(v["grads"] > 0 for v in values)
    for rank, v in enumerate(values):
        assert v["loss"] <= 1e-9 and v["grad"] <= 1e-9, f"rank {rank}: {v}"
        # each layer's outputs are kept from forward to backward only where B and W split (issue 29)
        assert (v["boundaries_held"] > 0) == name.endswith("zb_h1"), f"rank {rank}: {v}"
