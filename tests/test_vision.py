"""Tests for pipeflow.models.zoo (torchvision models split by from_module) and pipeflow.data.vision."""
from __future__ import annotations

from pathlib import Path
from urllib.error import URLError

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock

from pipeflow.errors import ConfigError
from pipeflow.models import get_model_builder, run_layers
from pipeflow.models.zoo import build_resnet, build_torchvision
from pipeflow.data.vision import IMAGE_DATASETS, build_image_batches

try:  # pytest puts tests/ on sys.path when tests/ is not a package
    import vision_fixtures as fx
except ImportError:  # pragma: no cover - tests/ became a package
    from tests import vision_fixtures as fx

F64 = torch.float64


def _images(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _cifar_torchvision_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 with the CIFAR stem: 3x3 stride-1 conv1, no max-pool."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _num_params(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


# ---------------------------------------------------------------- the model


def test_resnet18_layer_names() -> None:
    blocks = [f"layer{k}.{j}" for k in range(1, 5) for j in range(2)]
    assert build_resnet("resnet18").layer_names() == ["stem", *blocks, "head"]
    assert len(build_resnet("resnet50")) == 2 + 3 + 4 + 6 + 3


def test_chain_equals_one_sequential_of_the_same_modules() -> None:
    layers = build_resnet("resnet18").build_all(dtype=F64)
    for layer in layers:
        layer.eval()
    x = _images((4, 3, 16, 16))
    assert torch.equal(run_layers(layers, x), nn.Sequential(*layers)(x))


def _merged(layers) -> dict:
    merged = {}
    for layer in layers:
        merged.update(layer.state_dict())
    return merged


@pytest.mark.parametrize("small_input", [True, False])
def test_equals_torchvision_resnet18(small_input: bool) -> None:
    """Same parameter count, the layers' state dict keys are torchvision's, and with copied
    weights the same logits."""
    spec = build_resnet("resnet18", num_classes=10, small_input=small_input)
    layers = spec.build_all(dtype=F64)
    ref = _cifar_torchvision_resnet18() if small_input else torchvision.models.resnet18(
        weights=None, num_classes=10
    )
    ref = ref.to(F64)
    assert _num_params(layers) == _num_params([ref])
    ours = _merged(layers)
    assert sorted(ours) == sorted(ref.state_dict())
    ref.load_state_dict(ours)
    for module in (*layers, ref):
        module.eval()
    size = 32 if small_input else 64
    x = _images((4, 3, size, size))
    out = run_layers(layers, x)
    assert out.shape == (4, 10)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=1e-12)


def test_torchvision_weights_load_into_layers(tmp_path: Path) -> None:
    """The other way: model.init_from=<torchvision state dict>, each layer reading its own keys."""
    ref = _cifar_torchvision_resnet18().to(F64).eval()
    torch.save(ref.state_dict(), tmp_path / "resnet18.pt")
    spec = build_resnet("resnet18", init_from=str(tmp_path / "resnet18.pt"))
    layers = spec.build_all(dtype=F64)
    for layer in layers:
        layer.eval()
    x = _images((2, 3, 32, 32), seed=1)
    torch.testing.assert_close(run_layers(layers, x), ref(x), rtol=0, atol=0)
    stem = {k: v for k, v in ref.state_dict().items() if k.startswith(("conv1.", "bn1."))}
    torch.save(stem, tmp_path / "stem_only.pt")
    partial = build_resnet("resnet18", init_from=str(tmp_path / "stem_only.pt"))
    partial.build_layers([0])  # the stem reads only its own tensors
    with pytest.raises(ConfigError, match="layer 'layer1.0': model.init_from=.* has no 'layer1.0.conv1.weight'"):
        partial.build_layers([1])


def test_resnet50_forward() -> None:
    spec = build_resnet("resnet50", num_classes=10)
    out = run_layers(spec.build_all(), torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert _num_params(spec.build_layers([len(spec) - 1])) == 2048 * 10 + 10  # the head: fc


def test_building_one_layer_builds_only_that_block() -> None:
    spec = build_resnet("resnet18")
    ref = _cifar_torchvision_resnet18()
    assert _num_params(spec.build_layers([1])) == _num_params([BasicBlock(64, 64)])
    (down,) = spec.build_layers([spec.layer_names().index("layer2.0")])  # has a downsample
    assert _num_params([down]) == _num_params([ref.layer2[0]])
    block = down.get_submodule("layer2.0")
    assert isinstance(block, BasicBlock) and block.downsample is not None


def test_init_like_torchvision_and_deterministic() -> None:
    spec = build_resnet("resnet18")
    block = spec.build_layers([1])[0].get_submodule("layer1.0")
    assert torch.equal(block.bn1.weight, torch.ones(64))
    assert torch.equal(block.bn1.bias, torch.zeros(64))
    fan_out = 64 * 3 * 3  # kaiming normal, mode fan_out: std = sqrt(2 / fan_out)
    assert abs(block.conv1.weight.std().item() - (2 / fan_out) ** 0.5) < 0.005
    again = spec.build_layers([1])[0].get_submodule("layer1.0")
    assert torch.equal(block.conv1.weight, again.conv1.weight)
    zero = build_resnet("resnet50", zero_init_residual=True).build_layers([1])[0].get_submodule("layer1.0")
    assert torch.equal(zero.bn3.weight, torch.zeros(256))


def test_eval_mode_is_independent_of_micro_batching() -> None:
    """Running statistics: splitting the batch changes nothing.  Batch statistics: it does."""
    layers = build_resnet("resnet18").build_all(dtype=F64)
    x = _images((4, 3, 16, 16), seed=2)
    for layer in layers:
        layer.eval()
    whole = run_layers(layers, x)
    torch.testing.assert_close(torch.cat([run_layers(layers, x[:2]), run_layers(layers, x[2:])]),
                               whole, rtol=0, atol=1e-12)
    for layer in layers:
        layer.train()
    with torch.no_grad():
        split = torch.cat([run_layers(layers, x[:2]), run_layers(layers, x[2:])])
        assert not torch.allclose(split, run_layers(layers, x))


def test_registry_and_errors() -> None:
    assert len(get_model_builder("resnet18")()) == 10
    assert len(get_model_builder("resnet50")()) == 18
    assert len(get_model_builder("resnet")(arch="resnet34")) == 2 + 16
    mnist = get_model_builder("resnet18")(in_channels=1, num_classes=10)
    assert run_layers(mnist.build_all(), torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError, match="unknown model.arch='resnet7'"):
        build_resnet("resnet7")
    with pytest.raises(ConfigError, match="cannot build model.arch='resnet50'"):
        get_model_builder("resnet18")(arch="resnet50")


# ---------------------------------------------------------------- the data


def _pixels(x: torch.Tensor, name: str) -> torch.Tensor:
    """Undo Normalize and ToTensor: the uint8 values of pixel (0, 0) per channel, (B, C)."""
    info = IMAGE_DATASETS[name]
    mean, std = torch.tensor(info.mean), torch.tensor(info.std)
    return ((x[:, :, 0, 0] * std + mean) * 255).round().long()


def test_cifar10_through_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fx.write_cifar10(tmp_path, per_batch=4, test_size=6)
    fx.use_tiny_cifar10_checksums(monkeypatch, root)
    source = build_image_batches("cifar10", root, batch_size=4, seed=3)
    assert source.num_samples == 20 and source.classes == fx.CIFAR_CLASSES
    x, y = source.get(0)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
    i = source.indices(0)
    expected = torch.stack([(i + 50 * c) % 256 for c in range(3)], dim=1)
    assert torch.equal(_pixels(x, "cifar10"), expected) and torch.equal(y, i % 10)
    # One epoch (5 steps of 4) visits every training image once; the order is seeded.
    seen = torch.cat([source.indices(step) for step in range(5)])
    assert sorted(seen.tolist()) == list(range(20))
    again = build_image_batches("cifar10", root, batch_size=4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(source.get(7), again.get(7)))
    assert not torch.equal(source.indices(5), source.indices(0))  # a new epoch, a new order
    test = build_image_batches("cifar10", root, batch_size=8, seed=3, train=False)
    assert test.num_samples == 6 and test.get(0)[0].shape == (8, 3, 32, 32)


def test_cifar10_md5_is_still_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fx.write_cifar10(tmp_path)
    with pytest.raises(ConfigError, match="CIFAR-10 under data.root=.* is incomplete or corrupted"):
        build_image_batches("cifar10", root, batch_size=2, seed=0)  # the real md5s do not match
    fx.use_tiny_cifar10_checksums(monkeypatch, root)
    (root / fx.CIFAR_FOLDER / "data_batch_3").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match=r"md5 check: \['data_batch_3'\]"):
        build_image_batches("cifar10", root, batch_size=2, seed=0)


def test_missing_datasets_say_what_to_do(tmp_path: Path) -> None:
    message = (f"CIFAR-10 not found under data.root='{tmp_path}' (expected "
               f"<root>/cifar-10-batches-py/{{data_batch_1..5, test_batch, batches.meta}}); set "
               "data.download=true on a machine with internet or point data.root at the folder "
               "that holds cifar-10-batches-py")
    with pytest.raises(ConfigError) as err:
        build_image_batches("cifar10", tmp_path, batch_size=2, seed=0)
    assert str(err.value) == message
    with pytest.raises(ConfigError, match="MNIST not found under data.root=.*data.download=true"):
        build_image_batches("mnist", tmp_path, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="ImageFolder training images not found"):
        build_image_batches("imagefolder", tmp_path / "nowhere", batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="unknown image data set data.name='svhn'"):
        build_image_batches("svhn", tmp_path, batch_size=2, seed=0)


def test_failed_download_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise URLError("no internet")

    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)
    with pytest.raises(ConfigError, match="CIFAR-10 could not be downloaded into data.root="):
        build_image_batches("cifar10", tmp_path, batch_size=2, seed=0, download=True)


def test_mnist_through_torchvision(tmp_path: Path) -> None:
    root = fx.write_mnist(tmp_path, train_size=12, test_size=5)
    source = build_image_batches("mnist", root, batch_size=5, seed=0)
    x, y = source.get(4)
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.long
    i = source.indices(4)
    assert torch.equal(_pixels(x, "mnist")[:, 0], i % 256) and torch.equal(y, i % 10)
    assert all(torch.equal(a, b) for a, b in zip(source.get(4), source.get(4)))
    test = build_image_batches("mnist", root, batch_size=3, seed=0, train=False, image_size=32)
    assert test.num_samples == 5 and test.get(0)[0].shape == (3, 1, 32, 32)


def test_image_folder_through_torchvision(tmp_path: Path) -> None:
    root = fx.write_image_folder(tmp_path, per_class=3)
    source = build_image_batches("imagefolder", root, batch_size=4, seed=0, image_size=16)
    assert source.classes == ["cat", "dog"] and source.num_samples == 6
    x, y = source.get(1)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.long
    colours = torch.tensor([fx.FOLDER_COLOURS["cat"], fx.FOLDER_COLOURS["dog"]])
    assert torch.equal(_pixels(x, "imagefolder"), colours[y])
    val = build_image_batches("imagefolder", root, batch_size=2, seed=0, train=False, image_size=16)
    assert val.get(0)[0].shape == (2, 3, 16, 16)
    with pytest.raises(ConfigError, match="not supported for data=imagefolder"):
        build_image_batches("imagefolder", root, batch_size=2, seed=0, download=True)


def test_fake_data_is_deterministic_and_leaves_the_global_rng() -> None:
    source = build_image_batches("fakedata", "unused", batch_size=3, seed=0, fake_size=16)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    x, y = source.get(2)
    assert torch.equal(torch.rand(3), expected)
    assert x.shape == (3, 3, 32, 32) and y.dtype == torch.long and int(y.max()) < 10
    assert torch.equal(source.get(2)[0], x)
    val = build_image_batches("fakedata", "unused", batch_size=3, seed=0, train=False, fake_size=16)
    assert val.num_samples == 4 and not torch.equal(val.get(0)[0], source.get(0)[0][:3])


def test_going_back_to_an_earlier_epoch_keeps_its_order() -> None:
    """Evaluation restarts at batch 0 each time: with a val split smaller than a few batches the
    epoch it asks for is older than the two cached ones, and must not be evicted on arrival."""
    source = build_image_batches("fakedata", "unused", batch_size=8, seed=0, train=False, fake_size=16)
    first = source.indices(0)
    source.indices(3)  # epochs 6 and 7
    assert torch.equal(source.indices(0), first)


def test_resnet_trains_on_a_cifar_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fx.write_cifar10(tmp_path)
    fx.use_tiny_cifar10_checksums(monkeypatch, root)
    x, y = build_image_batches("cifar10", root, batch_size=4, seed=0).get(0)
    spec = build_resnet("resnet18")
    loss = spec.loss_fn(run_layers(spec.build_all(), x), y)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
