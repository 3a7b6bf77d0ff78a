"""Data that needs no download: deterministic from a seed, identical on every rank.

Token streams (a seeded sparse Markov chain, or a text file) cut into random windows for a GPT,
and Gaussian clusters for the MLP.  Batch `step` is always drawn from a generator seeded from
(seed, step), so any rank can produce any batch without shared state.
"""
from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeflow.errors import ConfigError
from pipeflow.models.spec import derive_seed


def _generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded from the given integers and tags."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def markov_transitions(
    vocab_size: int, seed: int, num_successors: int = 4, smoothing: float = 0.02
) -> Tensor:
    """The transition matrix P[a, b] = p(next = b | current = a) of a seeded sparse Markov chain.

    Each token has `num_successors` likely successors (random weights) holding 1 - smoothing of
    the mass; the rest is spread uniformly so the chain is irreducible and aperiodic.

    Args:
        vocab_size: V, the number of tokens (>= 2).
        seed: the chain's seed.
        num_successors: likely successors per token (clamped to V).
        smoothing: probability mass spread uniformly over all tokens, in [0, 1].

    Returns:
        A float64 (V, V) row-stochastic matrix.

    Raises:
        ConfigError: vocab_size < 2, num_successors < 1 or smoothing outside [0, 1].
    """
    if vocab_size < 2 or num_successors < 1 or not 0.0 <= smoothing <= 1.0:
        raise ConfigError(
            f"markov chain needs vocab_size >= 2, num_successors >= 1, 0 <= smoothing <= 1; "
            f"got vocab_size={vocab_size}, num_successors={num_successors}, smoothing={smoothing}"
        )
    k = min(num_successors, vocab_size)
    gen = _generator("markov-chain", seed, vocab_size, k)
    sparse = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for a in range(vocab_size):
        successors = torch.randperm(vocab_size, generator=gen)[:k]
        weights = torch.rand(k, generator=gen, dtype=torch.float64) + 0.25
        sparse[a, successors] = weights / weights.sum()
    return (1.0 - smoothing) * sparse + smoothing / vocab_size


def markov_entropy_rate(
    vocab_size: int, seed: int, num_successors: int = 4, smoothing: float = 0.02
) -> float:
    """The chain's entropy rate in nats: the lowest mean loss any next-token model can reach.

    Args:
        vocab_size, seed, num_successors, smoothing: as for `markov_tokens`.

    Returns:
        H = -sum_a pi_a sum_b P[a, b] ln P[a, b], with pi the stationary distribution.
    """
    P = markov_transitions(vocab_size, seed, num_successors, smoothing)
    pi = torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64)
    for _ in range(10_000):  # power iteration; converges fast for a smoothed chain
        nxt = pi @ P
        done = torch.allclose(nxt, pi, rtol=0.0, atol=1e-13)
        pi = nxt
        if done:
            break
    plogp = torch.where(P > 0, P * P.clamp_min(1e-300).log(), torch.zeros_like(P))
    return float(-(pi * plogp.sum(dim=1)).sum())


def markov_tokens(
    num_tokens: int,
    vocab_size: int,
    seed: int,
    num_successors: int = 4,
    smoothing: float = 0.02,
) -> Tensor:
    """A token stream sampled from the seeded sparse Markov chain of `markov_transitions`.

    A small GPT learns it quickly: its loss falls from ln(V) toward `markov_entropy_rate`.

    Args:
        num_tokens: length of the stream (>= 1).
        vocab_size: V.
        seed: seeds both the chain and the sampling.
        num_successors: likely successors per token.
        smoothing: uniform mass that keeps every transition possible.

    Returns:
        A 1-D int64 tensor of `num_tokens` ids in [0, V).

    Raises:
        ConfigError: num_tokens < 1 or bad chain parameters.
    """
    if num_tokens < 1:
        raise ConfigError(f"num_tokens={num_tokens} must be >= 1")
    cdf = markov_transitions(vocab_size, seed, num_successors, smoothing).cumsum(dim=1).tolist()
    gen = _generator("markov-sample", seed)
    first = int(torch.randint(vocab_size, (1,), generator=gen))
    uniforms = torch.rand(num_tokens - 1, generator=gen, dtype=torch.float64).tolist()
    out = [first]
    for u in uniforms:  # plain Python: ~1 s per million tokens
        out.append(min(bisect.bisect_right(cdf[out[-1]], u), vocab_size - 1))
    return torch.tensor(out, dtype=torch.long)


def text_file_tokens(path: str | Path, level: str = "char",
                     chars: list[str] | None = None) -> tuple[Tensor, list[str] | None]:
    """Read a text file as a token stream.

    Args:
        path: the file.
        level: "byte" (ids are the raw bytes, vocabulary size 256) or "char" (ids index a
            sorted vocabulary of the UTF-8 characters present).
        chars: "char": the vocabulary to index instead (another file's, for held-out text).

    Returns:
        (1-D int64 tokens, vocabulary): the vocabulary is the sorted list of characters for
        "char", None for "byte" (id i is byte i).

    Raises:
        ConfigError: the file is missing, is not a file, is empty, is not UTF-8 (char level),
            or `level` is unknown; (with `chars`) a character outside them.
    """
    path = Path(path)
    if level not in ("char", "byte"):
        raise ConfigError(f"data.level={level!r} is unknown; use 'char' or 'byte'")
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise ConfigError(f"data file {str(path)!r} {what}; set data.path to a text file")
    raw = path.read_bytes()
    if not raw:
        raise ConfigError(f"data file {str(path)!r} is empty")
    if level == "byte":
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long(), None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"data file {str(path)!r} is not UTF-8 ({err}); use level='byte'"
        ) from err
    vocab = sorted(set(text)) if chars is None else chars
    index = {ch: i for i, ch in enumerate(vocab)}
    unknown = sorted(set(text) - set(index)) if chars is not None else []
    if unknown:
        raise ConfigError(f"data file {str(path)!r} holds characters the training text has not ({unknown[:5]}): "
                          f"a char-level vocabulary is the training file's; use data.level=byte")
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), vocab


def split_tokens(tokens: Tensor, val_fraction: float) -> tuple[Tensor, Tensor]:
    """Split a stream into (train, val): the last `val_fraction` of it is validation.

    Args:
        tokens: a 1-D tensor.
        val_fraction: in [0, 1); 0 gives an empty validation stream.

    Returns:
        (train, val) views of `tokens`.

    Raises:
        ConfigError: val_fraction is outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    n_val = int(math.floor(len(tokens) * val_fraction))
    cut = len(tokens) - n_val
    return tokens[:cut], tokens[cut:]


class TokenBatches:
    """Random windows of a token stream: batch `step` is (x, y) with y = x shifted by one.

    With `lengths` = (shortest, longest) the batch comes as `chunks` micro-batches (rows split as
    evenly as they go, sizes differing by at most one), each its own sequence length drawn
    uniformly from that range: ``([x_0, x_1, ...], [y_0, y_1, ...])``; deterministic per step.
    A subclass reads its windows elsewhere (:meth:`windows`, token files) or makes other inputs of
    them (:meth:`inputs`, packed documents); `labels` tag its seeds.
    """

    labels = ("token-batch", "token-lengths")  # the seeds' tags: windows, lengths

    def __init__(
        self, tokens: Any, seq_len: int, batch_size: int, seed: int, lengths: tuple[int, int] | None = None,
        chunks: int = 1,
    ) -> None:
        """Args: tokens (a 1-D long tensor, or a subclass's stream with a length), seq_len T,
        batch_size B, seed, lengths (variable lengths), chunks.

        Raises:
            ConfigError: T or B < 1, the stream is shorter than T + 1 tokens, or the lengths
                are not 1 <= shortest <= longest <= T.
        """
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
        if (isinstance(tokens, Tensor) and tokens.dim() != 1) or len(tokens) < seq_len + 1:
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else (len(tokens),)
            raise ConfigError(
                f"token stream of shape {shape} is too short for seq_len={seq_len}; need a 1-D stream of at least "
                f"{seq_len + 1} tokens (lower data.seq_len, or data.val_fraction for the validation stream)"
            )
        if lengths is not None and not 1 <= lengths[0] <= lengths[1] <= seq_len:
            raise ConfigError(f"sequence lengths {lengths[0]}..{lengths[1]} must lie in 1..data.seq_len={seq_len}")
        if not 1 <= chunks <= batch_size:
            raise ConfigError(f"{batch_size} rows cannot make {chunks} micro-batches of at least one row each")
        self.tokens = tokens.long() if isinstance(tokens, Tensor) else tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.lengths, self.chunks = lengths, chunks

    def windows(self, starts: Tensor) -> Tensor:
        """Tokens s .. s + T of the stream for each start s: (B,) -> (B, T + 1) long."""
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]

    def inputs(self, x: Tensor) -> Any:
        """A micro-batch's model input made of its tokens x (B, T): the tokens themselves."""
        return x

    def get(self, step: int) -> tuple[Any, Tensor] | tuple[list[Any], list[Tensor]]:
        """Return batch `step`: x (B, T) long and y (B, T) long, the same on every call and rank;
        with variable lengths, lists of `chunks` such pairs' halves, micro-batch k of shape (B_k, T_k)."""
        if self.lengths is None:
            return self.take(step, step * self.batch_size, self.batch_size)
        gen = _generator(self.labels[0], self.seed, step)
        num_starts = len(self.tokens) - self.seq_len  # start s needs tokens s .. s + T
        window = self.windows(torch.randint(num_starts, (self.batch_size,), generator=gen))  # (B, T + 1)
        low, high = self.lengths
        sizes = torch.randint(low, high + 1, (self.chunks,), generator=_generator(self.labels[1], self.seed, step))
        parts = [w[:, : int(t) + 1] for w, t in zip(window.tensor_split(self.chunks), sizes)]
        return [self.inputs(w[:, :-1]) for w in parts], [w[:, 1:] for w in parts]

    def take(self, step: int, start: int, count: int) -> tuple[Any, Tensor]:
        """Batch `step` of `count` rows (``train.batch_ramp``): the batch a source of
        ``batch_size=count`` gives at `step` (each step draws its own windows; `start`, the
        samples consumed before it, does not move them)."""
        gen = _generator(self.labels[0], self.seed, step)
        num_starts = len(self.tokens) - self.seq_len  # start s needs tokens s .. s + T
        window = self.windows(torch.randint(num_starts, (count,), generator=gen))  # (count, T + 1)
        return self.inputs(window[:, :-1]), window[:, 1:]


class ClassificationBatches:
    """Gaussian clusters, one per class, for the MLP: batch `step` is (x (B, in) float32, y (B,)).

    The class centers are fixed by the seed; each sample is its center plus Gaussian noise.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        batch_size: int,
        seed: int,
        noise: float = 1.0,
        spread: float = 2.0,
        split: str = "train",
    ) -> None:
        """Args: in_features, num_classes, batch_size, seed; noise, spread (cluster, center std);
        split: names the sample stream ("train", "val"): same centers, different samples.

        Raises:
            ConfigError: a size is < 1.
        """
        if min(in_features, num_classes, batch_size) < 1:
            raise ConfigError(
                f"in_features={in_features}, num_classes={num_classes}, "
                f"batch_size={batch_size} must all be >= 1"
            )
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.noise = noise
        self.seed = seed
        self.split = split
        gen = _generator("class-centers", seed)  # fixed for the data set
        self.centers = spread * torch.randn(num_classes, in_features, generator=gen)

    def get(self, step: int) -> tuple[Tensor, Tensor]:
        """Return batch `step`: x (B, in_features) float32 and y (B,) long class ids."""
        return self.take(step, step * self.batch_size, self.batch_size)

    def take(self, step: int, start: int, count: int) -> tuple[Tensor, Tensor]:
        """Batch `step` of `count` samples (``train.batch_ramp``), as a source of
        ``batch_size=count`` gives it (each step draws its own; `start` does not move them)."""
        gen = _generator("class-batch", self.split, self.seed, step)
        y = torch.randint(self.num_classes, (count,), generator=gen)
        noise = torch.randn(count, self.centers.size(1), generator=gen)
        return self.centers[y] + self.noise * noise, y
