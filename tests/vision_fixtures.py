"""Test helpers: tiny image data sets written in the real on-disk formats torchvision reads.

Not a test file.  Pixel values encode the sample index so tests can check which image came back:
CIFAR-10 image i has channel c filled with (i + 50 c) mod 256 and label i mod 10 (i counts over
data_batch_1..5 in order, and over test_batch separately); MNIST image i is filled with i mod 256,
label i mod 10.

CIFAR-10 checksums.  torchvision's CIFAR10 verifies the md5 of every batch file and of
batches.meta against constants on the class (``train_list``, ``test_list``, ``meta``); no tiny
file can match the real data's md5s.  Rather than stub the check out, `cifar10_checksums` gives
the md5s of the files written here, and tests install them on the class with
``monkeypatch.setattr`` (see `use_tiny_cifar10_checksums`), so torchvision's own integrity check
still runs, on these files.  MNIST checks only that its four raw files exist: nothing to patch.
"""
from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN_FILES = [f"data_batch_{k}" for k in range(1, 6)]
CIFAR_TEST_FILE = "test_batch"
CIFAR_META_FILE = "batches.meta"
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck"]
MNIST_FILES = {  # split -> (images file, labels file), under <root>/MNIST/raw/
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def cifar_image(i: int) -> np.ndarray:
    """Image i as one CIFAR row: (3072,) uint8, 1024 red then 1024 green then 1024 blue values."""
    return np.concatenate([np.full(1024, (i + 50 * c) % 256, dtype=np.uint8) for c in range(3)])


def _dump(path: Path, obj: Any) -> None:
    """Pickle like the original Python 2 files: str keys, read back with encoding='latin1'."""
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(root: str | Path, per_batch: int = 4, test_size: int = 6) -> Path:
    """Write cifar-10-batches-py/ with 5 train batches of `per_batch` images and a test batch.

    Keys are those of the real files: data (N, 3072) uint8, labels (list of int), batch_label,
    filenames; batches.meta has label_names, num_cases_per_batch, num_vis.

    Returns:
        The root (the folder that holds cifar-10-batches-py).
    """
    root = Path(root)
    folder = root / CIFAR_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    batches = [(name, range(k * per_batch, (k + 1) * per_batch))
               for k, name in enumerate(CIFAR_TRAIN_FILES)]
    batches.append((CIFAR_TEST_FILE, range(test_size)))
    for name, indices in batches:
        _dump(folder / name, {
            "batch_label": f"{name} of 5",
            "labels": [i % 10 for i in indices],
            "data": np.stack([cifar_image(i) for i in indices]),
            "filenames": [f"img_{i}.png" for i in indices],
        })
    _dump(folder / CIFAR_META_FILE,
          {"num_cases_per_batch": per_batch, "label_names": CIFAR_CLASSES, "num_vis": 3072})
    return root


def cifar10_checksums(root: str | Path) -> dict[str, str]:
    """The md5 of each file written by `write_cifar10` under `root`, by file name."""
    folder = Path(root) / CIFAR_FOLDER
    names = [*CIFAR_TRAIN_FILES, CIFAR_TEST_FILE, CIFAR_META_FILE]
    return {name: hashlib.md5((folder / name).read_bytes()).hexdigest() for name in names}


def use_tiny_cifar10_checksums(monkeypatch: Any, root: str | Path) -> None:
    """Make torchvision's CIFAR10 expect the md5s of the tiny files (undone after the test)."""
    from torchvision.datasets import CIFAR10

    md5 = cifar10_checksums(root)
    monkeypatch.setattr(CIFAR10, "train_list", [[n, md5[n]] for n in CIFAR_TRAIN_FILES])
    monkeypatch.setattr(CIFAR10, "test_list", [[CIFAR_TEST_FILE, md5[CIFAR_TEST_FILE]]])
    meta = {"filename": CIFAR_META_FILE, "key": "label_names", "md5": md5[CIFAR_META_FILE]}
    monkeypatch.setattr(CIFAR10, "meta", meta)


def _idx(path: Path, array: np.ndarray) -> None:
    """Write an IDX file: magic (0, 0, type 0x08 = uint8, ndim), big-endian int32 dims, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: str | Path, train_size: int = 12, test_size: int = 5) -> Path:
    """Write MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (uncompressed IDX).

    Returns:
        The root (the folder that holds MNIST/).
    """
    root = Path(root)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for train, n in ((True, train_size), (False, test_size)):
        images_file, labels_file = MNIST_FILES[train]
        images = np.stack([np.full((28, 28), i % 256, dtype=np.uint8) for i in range(n)])
        _idx(raw / images_file, images)
        _idx(raw / labels_file, np.arange(n, dtype=np.uint8) % 10)
    return root


FOLDER_COLOURS = {"cat": (200, 30, 30), "dog": (30, 30, 200)}  # class -> solid RGB colour


def write_image_folder(
    root: str | Path, per_class: int = 3, splits: tuple[str, ...] = ("train", "val")
) -> Path:
    """Write <root>/<split>/<class>/img_k.png: solid-colour PNGs of varying sizes (and modes).

    Returns:
        The root (the folder that holds train/ and val/).
    """
    root = Path(root)
    for split in splits:
        for name, colour in FOLDER_COLOURS.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                size = (20 + 4 * k, 16 + 2 * k)  # (W, H): different sizes, resized then cropped
                image = Image.new("RGB", size, colour)
                if k == 1:
                    image = image.convert("RGBA")  # ImageFolder's loader converts to RGB
                image.save(folder / f"img_{k}.png")
    return root
