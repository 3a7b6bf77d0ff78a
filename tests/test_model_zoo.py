"""``model=torchvision`` and ``model=module``: models split by from_module, selected by config.

torchvision's own classes with copied weights are the reference (float64, eval mode); the
large presets are checked on the meta device (their structure and parameter count), the forward
on small instances of the same classes through the same recipes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torchvision
from hydra.utils import instantiate
from torchvision.models.convnext import CNBlock, CNBlockConfig, ConvNeXt
from torchvision.models.vision_transformer import VisionTransformer

from pipeflow.errors import ConfigError
from pipeflow.models import from_module, run_layers
from pipeflow.models import zoo
from pipeflow.commands.plan.command import compose_config
from pipeflow.runtime.tied import tie_in_place

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
F64 = torch.float64


def _merged(layers) -> dict:
    merged = {}
    for layer in layers:
        merged.update(layer.state_dict())
    return merged


def _equals_reference(spec, reference: torch.nn.Module, x: torch.Tensor) -> list[torch.nn.Module]:
    layers = spec.build_all(dtype=F64)
    tie_in_place(spec, dict(enumerate(layers)))
    reference = reference.to(F64)
    reference.load_state_dict(_merged(layers))
    for module in (*layers, reference):
        module.eval()
    torch.testing.assert_close(run_layers(layers, x), reference(x), rtol=0, atol=0)
    return layers


def _images(n: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=F64)


@pytest.mark.parametrize("name,layers", [("resnet18", 10), ("resnet50", 18), ("vit_b_16", 14), ("convnext_tiny", 26)])
def test_torchvision_presets_through_the_config_group(name: str, layers: int) -> None:
    """`model=torchvision model.name=<name>`: torchvision's model, unmodified, as layers (on meta:
    the structure and parameter count, nothing materialised)."""
    cfg = compose_config(["model=torchvision", f"model.name={name}", "data=fakedata"])
    spec = instantiate(cfg.model)
    assert len(spec) == layers and spec.layer_names()[0] == "stem" and spec.layer_names()[-1] == "head"
    with torch.device("meta"):
        ours = sum(p.numel() for layer in spec.layers for p in layer.build().parameters())
        kwargs = {"image_size": 32} if name.startswith("vit") else {}
        theirs = sum(p.numel() for p in torchvision.models.get_model(name, num_classes=10, **kwargs).parameters())
    assert ours == theirs


def test_resnet18_split_equals_torchvision() -> None:
    spec = zoo.build_torchvision("resnet18", num_classes=10)
    _equals_reference(spec, torchvision.models.resnet18(num_classes=10), _images())


def _small_vit() -> VisionTransformer:
    return VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=10)


def _recipe_spec(constructor, recipe: zoo.Recipe, seed: int = 0):
    return from_module(constructor, before=recipe.before, blocks=recipe.blocks, after=recipe.after,
                       before_fn=recipe.before_fn, after_fn=recipe.after_fn, init=recipe.init, seed=seed)


def test_vit_split_equals_torchvision_and_is_initialised_like_it() -> None:
    spec = _recipe_spec(_small_vit, zoo.VIT)
    assert len(spec) == 5
    layers = _equals_reference(spec, _small_vit(), _images())
    stem, head = layers[0], layers[-1]
    assert torch.equal(stem.get_parameter("class_token"), torch.zeros(1, 1, 16, dtype=F64))
    assert 0.01 < stem.get_parameter("encoder.pos_embedding").std().item() < 0.03  # N(0, 0.02)
    assert torch.equal(head.get_parameter("heads.head.weight"), torch.zeros(10, 16, dtype=F64))  # zero-init head


def _small_convnext() -> ConvNeXt:
    setting = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, 32, 2), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
    return ConvNeXt(setting, stochastic_depth_prob=0.0, num_classes=10)


def test_convnext_split_equals_torchvision_and_is_initialised_like_it() -> None:
    spec = _recipe_spec(_small_convnext, zoo.CONVNEXT)
    layers = _equals_reference(spec, _small_convnext(), _images())
    blocks = [m for layer in layers for m in layer.modules() if isinstance(m, CNBlock)]
    scale = torch.tensor(1e-6, dtype=torch.float32).double()  # built in float32, then cast
    assert len(blocks) == 5 and all(torch.all(b.layer_scale == scale) for b in blocks)
    assert all(b.stochastic_depth.p == 0.0 for b in blocks)  # off: runs are reproducible


def test_models_that_are_not_one_chain_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"model.name='googlenet' cannot be split.*auxiliary classifiers"):
        zoo.build_torchvision("googlenet")
    with pytest.raises(ConfigError, match=r"model.name='inception_v3' cannot be split.*aux_logits"):
        zoo.build_torchvision("inception_v3")
    with pytest.raises(ConfigError, match=r"model.name='alexnet' has no recipe.*model=module"):
        zoo.build_torchvision("alexnet")


def test_a_users_module_through_the_config_group_blocks_form() -> None:
    """`model=module model.module._target_=<class> model.before=[...] model.blocks=... model.after=[...]`."""
    from examples.your_module import GPT

    cfg = compose_config([
        "model=module", "model.module._target_=examples.your_module.GPT", "+model.module.vocab_size=64",
        "+model.module.block_size=16", "+model.module.n_layer=2", "+model.module.n_head=2", "+model.module.n_embd=16",
        "model.before=[tok_emb,pos_emb]", "model.before_fn={_target_:examples.your_module.embed,_partial_:true}",
        "model.blocks=blocks", "model.after=[ln_f,head]"])
    spec = instantiate(cfg.model)
    assert spec.layer_names() == ["before", "blocks.0", "blocks.1", "after"] and "tok_emb.weight" in spec.tied
    x = torch.randint(64, (2, 16))
    _equals_reference(spec, GPT(64, 16, 2, 2, 16), x)


def test_a_users_module_through_the_config_group_traced() -> None:
    from toy_models import SkipNet

    cfg = compose_config(["model=module", "model.module._target_=toy_models.SkipNet", "model.split_points=[b1,b3]"])
    spec = instantiate(cfg.model)
    assert len(spec) == 3
    _equals_reference(spec, SkipNet(), torch.randn(2, 32, dtype=F64))
    from pipeflow.models import build_module

    with pytest.raises(ConfigError, match=r"model=module needs model.module._target_"):
        build_module()


def test_init_from_loads_torchvision_weights_for_the_config_group(tmp_path: Path) -> None:
    """Fine-tuning a pretrained model is one override: model.init_from=<state dict file>."""
    reference = _small_vit()
    torch.save(reference.state_dict(), tmp_path / "vit.pt")
    spec = from_module(_small_vit, before=zoo.VIT.before, blocks=zoo.VIT.blocks, after=zoo.VIT.after,
                       before_fn=zoo.VIT.before_fn, after_fn=zoo.VIT.after_fn, init_from=str(tmp_path / "vit.pt"))
    layers = spec.build_all()
    for module in (*layers, reference):
        module.eval()
    x = _images().float()
    torch.testing.assert_close(run_layers(layers, x), reference(x), rtol=0, atol=0)
    cfg = compose_config(["model=torchvision", f"model.init_from={tmp_path / 'vit.pt'}"])
    assert cfg.model.init_from == str(tmp_path / "vit.pt")


def test_resnet_presets_are_unchanged_by_the_move_to_from_module() -> None:
    """model=resnet18 was a hand-flattened ResNet; built by from_module its layers, their names and
    (from the same seeds) the logits are as before: these fixed values were computed by the old code,
    on one CPU. Another CPU's BLAS rounds differently (3.5e-15 relative seen), hence the tolerance;
    a real change (another seed, layer or init) moves them by far more than 1e-10."""
    spec = zoo.build_resnet("resnet18", seed=3)
    assert spec.layer_names() == ["stem", *[f"layer{k}.{j}" for k in range(1, 5) for j in range(2)], "head"]
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=F64)
    out = run_layers(spec.build_all(dtype=F64), x)  # train mode, as the old code's value was taken
    before = [0.4453622008621107, 0.3881160804734136, -0.3740655450627898, -0.013523155890914532, -0.7502163107786688,
              0.113429584028378, -0.22627627435951841, 0.18827887811226485, 0.6296078587161678, 0.19249517779642702]
    torch.testing.assert_close(out[0], torch.tensor(before, dtype=F64), rtol=1e-10, atol=1e-12)
    assert out.sum().item() == pytest.approx(3.4635337459758, rel=1e-10)
