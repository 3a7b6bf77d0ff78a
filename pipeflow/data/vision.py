"""Image classification batches (CIFAR-10, MNIST, an ImageFolder tree, FakeData) via torchvision.

The data sets are torchvision's own classes, read from disk by torchvision's own code; only the
sampling is ours.  Batch `step` takes positions step*B .. step*B + B-1 of an endless stream made
of seeded permutations of the data set (one per epoch), then indexes the data set directly and
stacks the samples: no DataLoader, no worker processes, no shared state, so every rank computes
the same batch for the same step.  Transforms are deterministic (resize, ToTensor, Normalize with
the data set's mean and std); there is no random augmentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torchvision import datasets, transforms

from pipeflow.errors import ConfigError
from pipeflow.models.spec import derive_seed

FAKE_TEST_OFFSET = 1_000_000  # FakeData seeds image i from i + offset: the test split differs


@dataclass(frozen=True)
class ImageDataInfo:
    """What a data set needs: its display name, normalisation, channels, size and disk layout."""

    title: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int
    size: int  # native (or default) image side in pixels
    layout: str  # what data.root must hold, for error messages


IMAGE_DATASETS: dict[str, ImageDataInfo] = {
    # CIFAR-10 per-channel mean and std over the training set's pixels.
    "cifar10": ImageDataInfo(
        "CIFAR-10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 3, 32,
        "<root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}",
    ),
    "mnist": ImageDataInfo(
        "MNIST", (0.1307,), (0.3081,), 1, 28,
        "<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    ),
    # ImageNet statistics, the usual choice for photos.
    "imagefolder": ImageDataInfo(
        "ImageFolder", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 3, 224,
        "<root>/train/<class>/<image> and <root>/val/<class>/<image> (or <root>/<class>/<image>)",
    ),
    # FakeData draws N(0, 1) pixels; 0.5 / 0.5 maps ToTensor's [0, 1] to [-1, 1].
    "fakedata": ImageDataInfo("FakeData", (0.5,) * 3, (0.5,) * 3, 3, 32, "nothing (made up)"),
}


class ImageBatches:
    """Batch `step` of an image data set: x (B, C, H, W) float32, y (B,) long.

    Args:
        dataset: a map-style data set whose items are (image tensor (C, H, W), int label).
        batch_size: B.
        seed: seeds the per-epoch permutations.
        split: a tag that separates the sample orders of different splits ("train", "val").
        restore_rng: save and restore the global CPU and CUDA RNG around each batch (FakeData
            reseeds the global generator for every image).
    """

    def __init__(
        self, dataset: Any, batch_size: int, seed: int, split: str = "train",
        restore_rng: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size} must be >= 1")
        if len(dataset) < 1:
            raise ConfigError(f"the {split} image data set is empty")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.split = split
        self.restore_rng = restore_rng
        self.classes: list[str] = list(getattr(dataset, "classes", []))
        self._perms: dict[int, Tensor] = {}  # epoch -> permutation; the last two are kept

    @property
    def num_samples(self) -> int:
        """N, the number of images in the data set."""
        return len(self.dataset)

    def indices(self, step: int, start: int | None = None, count: int | None = None) -> Tensor:
        """The data set indices of batch `step`, (B,) long; the same on every call and rank; or of
        stream positions ``start .. start + count - 1`` (``train.batch_ramp``)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        n = self.num_samples
        count = self.batch_size if count is None else count
        start = step * self.batch_size if start is None else start
        pos = start + torch.arange(count)  # positions in the stream
        epochs, offsets = pos // n, pos % n
        out = torch.empty(count, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            chosen = epochs == epoch
            out[chosen] = self._permutation(epoch)[offsets[chosen]]
        return out

    def get(self, step: int) -> tuple[Tensor, Tensor]:
        """Return batch `step`: images (B, C, H, W) float32 and labels (B,) long."""
        return self.take(step, step * self.batch_size, self.batch_size)

    def take(self, step: int, start: int, count: int) -> tuple[Tensor, Tensor]:
        """The `count` images at stream positions `start` onwards (``train.batch_ramp``: a step's
        images follow the samples consumed before it)."""
        idx = self.indices(step, start, count).tolist()
        if self.restore_rng:
            devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
            with torch.random.fork_rng(devices=devices):
                samples = [self.dataset[i] for i in idx]
        else:
            samples = [self.dataset[i] for i in idx]
        x = torch.stack([image for image, _ in samples]).float()
        y = torch.tensor([int(label) for _, label in samples], dtype=torch.long)
        return x, y

    def _permutation(self, epoch: int) -> Tensor:
        """The seeded order of the data set in `epoch`."""
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(
                derive_seed("image-epoch", self.split, self.seed, epoch)
            )
            self._perms[epoch] = torch.randperm(self.num_samples, generator=gen)
            while len(self._perms) > 2:  # the oldest other epoch (going back to epoch 0 must not evict it)
                del self._perms[next(e for e in self._perms if e != epoch)]
        return self._perms[epoch]


def image_transform(name: str, image_size: int | None = None) -> transforms.Compose:
    """The deterministic transform for data set `name`: resize if asked, ToTensor, Normalize.

    CIFAR-10, MNIST and FakeData are resized to `image_size` only when it differs from their
    native size; ImageFolder images are resized (short side to size * 256/224) and
    center-cropped to `image_size` (default 224), the usual ImageNet evaluation transform.

    Args:
        name: a key of IMAGE_DATASETS.
        image_size: the side of the square output images (None: the data set's own size).

    Returns:
        A transform from a PIL image to a float32 (C, H, W) tensor.
    """
    info = _info(name)
    size = image_size or info.size
    steps: list[Any] = []
    if name == "imagefolder":
        steps += [transforms.Resize(round(size * 256 / 224)), transforms.CenterCrop(size)]
    elif size != info.size and name != "fakedata":  # FakeData is generated at `size` directly
        steps.append(transforms.Resize((size, size)))
    steps += [transforms.ToTensor(), transforms.Normalize(info.mean, info.std)]
    return transforms.Compose(steps)


def build_image_batches(
    name: str,
    root: str | Path,
    batch_size: int,
    seed: int,
    download: bool = False,
    train: bool = True,
    image_size: int | None = None,
    num_classes: int = 10,
    fake_size: int = 1024,
) -> ImageBatches:
    """Open a torchvision data set and wrap it as a deterministic batch source.

    Args:
        name: "cifar10", "mnist", "imagefolder" or "fakedata".
        root: the data folder (unused for fakedata); see IMAGE_DATASETS for the layout.
        batch_size: B.
        seed: seeds the sample order.
        download: let torchvision download CIFAR-10 / MNIST into `root` if missing.  With
            several ranks, download once beforehand (or on one rank, then a barrier).
        train: the training split, else the test split (ImageFolder: ``root/val``).
        image_size: side of the square images (None: the data set's own; ImageFolder 224).
        num_classes: classes of FakeData.
        fake_size: number of FakeData images (the test split has a quarter as many).

    Returns:
        An ImageBatches whose `get(step)` gives (x (B, C, H, W) float32, y (B,) long).

    Raises:
        ConfigError: unknown name, missing or unreadable data set, failed download.
    """
    transform = image_transform(name, image_size)
    split = "train" if train else "val"
    if name == "fakedata":
        side = image_size or IMAGE_DATASETS[name].size
        dataset = datasets.FakeData(
            size=fake_size if train else max(1, fake_size // 4), image_size=(3, side, side),
            num_classes=num_classes, transform=transform,
            random_offset=0 if train else FAKE_TEST_OFFSET,
        )
        dataset.classes = [str(k) for k in range(num_classes)]
        return ImageBatches(dataset, batch_size, seed, split, restore_rng=True)
    dataset = _open(name, Path(root), train, download, transform)
    return ImageBatches(dataset, batch_size, seed, split)


def _info(name: str) -> ImageDataInfo:
    """IMAGE_DATASETS[name], or a ConfigError listing the valid names."""
    try:
        return IMAGE_DATASETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown image data set data.name={name!r}; valid: {', '.join(IMAGE_DATASETS)}"
        ) from None


def _open(name: str, root: Path, train: bool, download: bool, transform: Any) -> Any:
    """Construct the torchvision data set; its failures become ConfigErrors saying what to do."""
    if name == "imagefolder":
        return _open_folder(root, train, download, transform)
    cls = datasets.CIFAR10 if name == "cifar10" else datasets.MNIST
    try:
        return cls(str(root), train=train, download=download, transform=transform)
    except (RuntimeError, OSError, ValueError, AssertionError, TypeError) as err:
        raise ConfigError(_failure(name, root, download, err)) from err


def _failure(name: str, root: Path, download: bool, err: Exception) -> str:
    """The message for a data set that could not be opened or downloaded."""
    info = IMAGE_DATASETS[name]
    top = root / ("cifar-10-batches-py" if name == "cifar10" else "MNIST")
    reason = f"{type(err).__name__}: {err}"
    if download:
        return (
            f"{info.title} could not be downloaded into data.root={str(root)!r} ({reason}); "
            f"this machine may have no internet: fetch it on one that has and point data.root "
            f"at the folder that holds {top.name}"
        )
    if not top.exists():
        return (
            f"{info.title} not found under data.root={str(root)!r} (expected {info.layout}); "
            f"set data.download=true on a machine with internet or point data.root at the "
            f"folder that holds {top.name}"
        )
    if name == "cifar10":
        reason += f"; files missing or failing torchvision's md5 check: {_bad_cifar_files(top)}"
    return (
        f"{info.title} under data.root={str(root)!r} is incomplete or corrupted ({reason}); "
        f"delete {str(top)!r} and set data.download=true on a machine with internet, or point "
        f"data.root at a good copy (expected {info.layout})"
    )


def _bad_cifar_files(folder: Path) -> list[str]:
    """The CIFAR-10 files under `folder` that are missing or whose md5 torchvision rejects."""
    from torchvision.datasets.utils import check_integrity

    cls = datasets.CIFAR10
    expected = [*cls.train_list, *cls.test_list, [cls.meta["filename"], cls.meta["md5"]]]
    return [name for name, md5 in expected if not check_integrity(str(folder / name), md5)]


def _open_folder(root: Path, train: bool, download: bool, transform: Any) -> Any:
    """An ImageFolder on root/train (or root itself) for training, root/val (or root/test) else."""
    if download:
        raise ConfigError("data.download=true is not supported for data=imagefolder; set it false")
    candidates = [root / "train", root] if train else [root / "val", root / "test"]
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is None:
        where = " or ".join(str(c) for c in candidates)
        raise ConfigError(
            f"ImageFolder {'training' if train else 'validation'} images not found under "
            f"data.root={str(root)!r}: no folder {where} "
            f"(expected {IMAGE_DATASETS['imagefolder'].layout})"
        )
    try:
        return datasets.ImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, OSError) as err:
        raise ConfigError(
            f"ImageFolder at {str(folder)!r} has no usable images ({err}); expected "
            f"{folder}/<class>/<image> with extensions {', '.join(datasets.folder.IMG_EXTENSIONS)}"
        ) from err
