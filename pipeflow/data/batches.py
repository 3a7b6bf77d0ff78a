"""The batches a run trains and evaluates on, named by ``data.name``, and how a global batch is
split: into data-parallel shards, then into micro-batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
TOKEN_DATA = ("markov", "text", "tokens", "chat")
FILE_DATA = ("text", "tokens", "chat")  # token data read from data.path, held out from data.eval_path


def build_batches(cfg: Any, model_cfg: Any, chunks: int = 1) -> Batches:
    """The data sources named by ``data.name`` (identical on every rank): validation batches from
    ``data.eval_path`` where it is set (text, tokens, chat), else from the last ``data.val_fraction``.

    Args:
        cfg: the ``data`` config.
        model_cfg: the ``model`` config (its vocabulary, checked against the data's).
        chunks: micro-batches in a global batch (dp x m); with ``data.variable_lengths`` each
            gets its own sequence length.

    Raises:
        ConfigError: unknown data name, or a vocabulary larger than the model's.
    """
    name = cfg.name
    eval_path = cfg.eval_path if name in FILE_DATA else None
    if name in IMAGE_DATA:
        from pipeflow.data.vision import build_image_batches  # torchvision costs seconds to import

        # each image source its own keys: a folder (cifar10, mnist, imagefolder), a download
        # (cifar10, mnist), a count of images (fakedata)
        own = {key: getattr(cfg, key) for key in ("root", "download", "fake_size") if hasattr(cfg, key)}
        make = lambda seed, train: build_image_batches(  # noqa: E731
            name, batch_size=cfg.batch_size, seed=seed, train=train, image_size=cfg.image_size,
            num_classes=cfg.num_classes, **{"root": "", **own})
        return Batches(make(cfg.seed, True), make(cfg.seed + 1, False))
    if name == "gaussian":
        make = lambda split: datasets.ClassificationBatches(  # noqa: E731
            cfg.in_features, cfg.num_classes, cfg.batch_size, cfg.seed, noise=4.0, split=split
        )
        return Batches(make("train"), make("val"))
    if name == "tokens":  # token files read through memory maps; the vocabulary is the model's
        from pipeflow.data.tokens import build_token_batches

        return Batches(*build_token_batches(cfg, model_cfg, sequence_lengths(cfg), chunks))
    if name == "chat":  # conversations, tokenised with the model's chat template, prompts masked
        from pipeflow.data.chat_rows import build_chat_batches

        return Batches(*build_chat_batches(cfg, model_cfg))
    if name == "markov":
        tokens = datasets.markov_tokens(cfg.num_tokens, cfg.vocab_size, cfg.seed)
        vocab, best = cfg.vocab_size, datasets.markov_entropy_rate(cfg.vocab_size, cfg.seed)
    elif name == "text":
        if cfg.path is None:
            raise ConfigError("data=text needs data.path=<a local text file>")
        tokens, chars = datasets.text_file_tokens(cfg.path, cfg.level)
        vocab, best = (256 if chars is None else len(chars)), None
    else:
        raise ConfigError(f"unknown data.name={name!r}; valid: markov, text, gaussian, {', '.join(IMAGE_DATA)}, "
                          f"tokens, chat")
    model_vocab = getattr(model_cfg, "vocab_size", vocab)
    if vocab > model_vocab:
        raise ConfigError(
            f"the data has a vocabulary of {vocab} tokens but model.vocab_size={model_vocab}; "
            f"set model.vocab_size={vocab}"
        )
    if eval_path is not None:  # data.path trained on whole, the held-out file in its vocabulary
        train, val = tokens, datasets.text_file_tokens(eval_path, cfg.level, chars)[0]
    else:
        train, val = datasets.split_tokens(tokens, cfg.val_fraction)
    lengths = sequence_lengths(cfg)
    return Batches(
        datasets.TokenBatches(train, cfg.seq_len, cfg.batch_size, cfg.seed, lengths, chunks),
        datasets.TokenBatches(val, cfg.seq_len, cfg.batch_size, cfg.seed + 1, lengths, chunks),
        best,
    )


def sequence_lengths(cfg: Any) -> tuple[int, int] | None:
    """``data.variable_lengths``: the range each micro-batch's sequence length is drawn from
    (``data.min_seq_len`` .. ``data.seq_len``); None for fixed lengths."""
    if cfg.name not in TOKEN_DATA or not cfg.variable_lengths:  # only token data has the key
        return None
    return (cfg.min_seq_len if cfg.min_seq_len is not None else max(1, cfg.seq_len // 4), cfg.seq_len)


def varies(cfg: Any, chunks: int) -> bool:
    """True when the micro-batches of a step can differ in shape: variable lengths, or a batch of
    rows that does not split into `chunks` equal micro-batches."""
    return sequence_lengths(cfg) is not None or cfg.batch_size % chunks != 0


def split_microbatches(batch: torch.Tensor | list[torch.Tensor], m: int) -> list[torch.Tensor]:
    """A batch as m micro-batches: a tensor split along dim 0 into sizes that differ by at most
    one row (the first ones larger); a list, already one entry per micro-batch, as it is.

    Raises:
        ConfigError: fewer rows than micro-batches, or a list of another length.
    """
    if isinstance(batch, list):
        if len(batch) != m:
            raise ConfigError(f"a batch of {len(batch)} micro-batches cannot be run as {m}")
        return batch
    if isinstance(batch, tuple):  # packed documents: (tokens, document ids), split alike
        return list(zip(*(split_microbatches(part, m) for part in batch)))
    if batch.shape[0] < m:
        raise ConfigError(f"a batch of {batch.shape[0]} rows cannot be split into {m} micro-batches of at least one row")
    return list(batch.tensor_split(m))


Batch = tuple[torch.Tensor, torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (floating data in `dtype` when given) without making the host wait.

    To a GPU the host tensor is copied once into pinned memory and from there asynchronously
    (``non_blocking``), so the host runs on while the copy is queued: a blocking copy from
    pageable memory would drain the device.  Each call pins a fresh buffer, which torch's caching
    host allocator does not hand out again before the copy that reads it has finished.
    """
    if isinstance(t, tuple):  # packed documents: (tokens, document ids)
        return tuple(to_device(part, device, dtype) for part in t)
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, dtype, non_blocking=True)
    return t.to(device, dtype)


def _on_device(batch: torch.Tensor | list[torch.Tensor], m: int, device: torch.device,
               dtype: torch.dtype | None) -> list[torch.Tensor]:
    """A batch as m micro-batches on `device`: a tensor moved once, then split there."""
    if isinstance(batch, list | tuple):
        return [to_device(mb, device, dtype) for mb in split_microbatches(batch, m)]
    return split_microbatches(to_device(batch, device, dtype), m)


def microbatch_inputs(x: torch.Tensor | list[torch.Tensor], m: int, device: torch.device,
                      dtype: torch.dtype) -> list[tuple[torch.Tensor]]:
    """Stage 0's m micro-batch inputs (one-tensor tuples) on `device`; floating-point data in the
    run's `dtype` (``train.param_dtype``), tokens and labels as they are."""
    return [mb if isinstance(mb, tuple) else (mb,) for mb in _on_device(x, m, device, dtype)]


def microbatch_targets(y: torch.Tensor | list[torch.Tensor], m: int, device: torch.device) -> list[torch.Tensor]:
    """The last stage's m micro-batch targets on `device`."""
    return _on_device(y, m, device, None)


def shard(batch: Batch, dp_rank: int, dp: int) -> Batch:
    """Data-parallel rank `dp_rank`'s contiguous share of the global batch (``data.batch_size``
    rows; sizes differ by at most one row, or, for a batch given as micro-batches, 1/dp of them).

    Every replica slices the same global batch, so the data stream does not depend on dp: a
    run resumed with another dp sees the same samples, and the dp run equals one replica on the
    whole batch.
    """
    if dp == 1:
        return batch
    return tuple(_share(part, dp_rank, dp) for part in batch)  # type: ignore[return-value]


def _share(part: torch.Tensor | list[torch.Tensor], dp_rank: int, dp: int) -> torch.Tensor | list[torch.Tensor]:
    if isinstance(part, list):
        per = len(part) // dp
        return part[dp_rank * per : (dp_rank + 1) * per]
    if isinstance(part, tuple):  # packed documents: (tokens, document ids)
        return tuple(_share(p, dp_rank, dp) for p in part)  # type: ignore[return-value]
    return part.tensor_split(dp)[dp_rank]


def loss_counts(targets: torch.Tensor | list[torch.Tensor], count: Callable[[Any], int] | None = None) -> int:
    """How many targets the loss counts in `targets` (a tensor, or a list of micro-batches'):
    `count` of each (``ModelSpec.loss_count``: cross entropy's targets other than -100); every
    element when `count` is None.  What weighs a micro-batch's mean loss in the batch's."""
    count = count or (lambda t: t.numel())
    return sum(count(t) for t in targets) if isinstance(targets, list) else count(targets)


def microbatch_counts(targets: torch.Tensor | list[torch.Tensor], m: int,
                      count: Callable[[Any], int] | None = None) -> list[int]:
    """The targets the loss counts in each of the m micro-batches of `targets` (this replica's
    share, still on the host: counting never waits for the device)."""
    return [loss_counts(t, count) for t in split_microbatches(targets, m)]
