"""The batches a run trains and evaluates on, named by ``data.name``, and how a global batch is
split: into data-parallel shards, then into micro-batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeflow.data import synthetic as datasets
from pipeflow.errors import ConfigError


@dataclass
class Batches:
    """Train and validation batch sources (each with ``get(step) -> (inputs, targets)``)."""

    train: Any
    val: Any
    best_loss: float | None = None  # lowest achievable loss, where the data knows it


IMAGE_DATA = ("cifar10", "mnist", "imagefolder", "fakedata")
TOKEN_DATA = ("markov", "text")


def build_batches(cfg: Any, model_cfg: Any) -> Batches:
    """The data sources named by ``data.name`` (identical on every rank).

    Raises:
        ConfigError: unknown data name, or a vocabulary larger than the model's.
    """
    name = cfg.name
    if name in IMAGE_DATA:
        from pipeflow.data.vision import build_image_batches  # torchvision costs seconds to import

        make = lambda seed, train: build_image_batches(  # noqa: E731
            name, cfg.root, cfg.batch_size, seed, cfg.download, train, cfg.image_size, cfg.num_classes, cfg.fake_size
        )
        return Batches(make(cfg.seed, True), make(cfg.seed + 1, False))
    if name == "gaussian":
        make = lambda split: datasets.ClassificationBatches(  # noqa: E731
            cfg.in_features, cfg.num_classes, cfg.batch_size, cfg.seed, noise=4.0, split=split
        )
        return Batches(make("train"), make("val"))
    if name == "markov":
        tokens = datasets.markov_tokens(cfg.num_tokens, cfg.vocab_size, cfg.seed)
        vocab, best = cfg.vocab_size, datasets.markov_entropy_rate(cfg.vocab_size, cfg.seed)
    elif name == "text":
        if cfg.path is None:
            raise ConfigError("data=text needs data.path=<a local text file>")
        tokens, chars = datasets.text_file_tokens(cfg.path, cfg.level)
        vocab, best = (256 if chars is None else len(chars)), None
    else:
        raise ConfigError(f"unknown data.name={name!r}; valid: markov, text, gaussian, {', '.join(IMAGE_DATA)}")
    model_vocab = getattr(model_cfg, "vocab_size", vocab)
    if vocab > model_vocab:
        raise ConfigError(
            f"the data has a vocabulary of {vocab} tokens but model.vocab_size={model_vocab}; "
            f"set model.vocab_size={vocab}"
        )
    train, val = datasets.split_tokens(tokens, cfg.val_fraction)
    return Batches(
        datasets.TokenBatches(train, cfg.seq_len, cfg.batch_size, cfg.seed),
        datasets.TokenBatches(val, cfg.seq_len, cfg.batch_size, cfg.seed + 1),
        best,
    )


def split_microbatches(tensor: torch.Tensor, m: int) -> list[torch.Tensor]:
    """Split a batch along dim 0 into m equal micro-batches."""
    if tensor.shape[0] % m:
        raise ConfigError(f"batch of {tensor.shape[0]} cannot be split into {m} equal micro-batches")
    return list(tensor.chunk(m))


def shard(batch: tuple[torch.Tensor, torch.Tensor], dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `dp_rank`'s contiguous 1/dp of the global batch (``data.batch_size`` rows).

    Every replica slices the same global batch, so the data stream does not depend on dp: a
    run resumed with another dp sees the same samples, and the dp run equals one replica on the
    whole batch.
    """
    if dp == 1:
        return batch
    x, y = batch
    rows = x.shape[0] // dp
    return x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
