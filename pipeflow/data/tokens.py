"""Token files on disk (``data=tokens``): headerless ``.bin`` (nanoGPT's layout) or ``.npy``
shards read through ``np.memmap``, cut into random windows; batch `step` is drawn from (seed,
step) only, so every rank reads the same batch and a resumed run continues the same stream.

Nothing is loaded whole: each file is a memory map, and a batch reads only its B windows of
T + 1 tokens.  The files, in name order, are one stream; its last ``data.val_fraction`` is the
validation stream, unless ``data.eval_path`` names held-out token files (then the validation
stream is theirs and ``data.path`` is trained on whole).  With ``data.pack_documents`` the inputs
are ``(tokens, document ids)`` as the built-in GPT takes them (pipeflow/models/gpt.py): ``data.eos_id`` opens a document, so an id
counts the end-of-document tokens up to and including its position within the row.
"""
from __future__ import annotations

import glob
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeflow.data.synthetic import TokenBatches
from pipeflow.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SUFFIXES = (".bin", ".npy")
_SCAN = 1 << 24  # tokens per chunk when the largest id is looked for (64 MiB of uint32)
_SAMPLE = 1 << 14  # tokens per window sampled for uint32 ids read as uint16
_MIN_PAIRS = 16  # fewer sampled pairs say nothing about the dtype


def matching_files(path: str | Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files `path` names, in name order: a glob's matches, a folder's files with one of
    `suffixes`, or the file itself (empty where nothing matches)."""
    text = str(path)
    if any(ch in text for ch in "*?["):
        return [Path(p) for p in sorted(glob.glob(text)) if Path(p).is_file()]
    if Path(text).is_dir():
        return sorted(p for p in Path(text).iterdir() if p.is_file() and p.suffix in suffixes)
    return [Path(text)] if Path(text).is_file() else []


def token_paths(path: str | Path, key: str = "data.path") -> list[Path]:
    """The token files `path` (the value of config `key`) names: a file, a folder (its ``*.bin``
    and ``*.npy`` files) or a glob, in name order.

    Raises:
        ConfigError: no file matches.
    """
    text = str(path)
    found = matching_files(text, SUFFIXES)
    if not found:
        where = "folder holds no .bin or .npy file" if Path(text).is_dir() else "matches no file"
        raise ConfigError(f"{key}={text!r} {where}; point it at token files (data=tokens)")
    return found


def open_tokens(path: Path, token_dtype: str = "uint16") -> np.ndarray:
    """One token file as a read-only 1-D memory map: ``.npy`` with its own (integer) dtype, any
    other file headerless in `token_dtype`.

    Raises:
        ConfigError: unknown dtype, a size that is not a multiple of the dtype, an empty file,
            or a ``.npy`` that is not a 1-D integer array.
    """
    if token_dtype not in DTYPES:
        raise ConfigError(f"data.token_dtype={token_dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as err:
            raise ConfigError(f"token file {str(path)!r} is not a readable .npy array ({err})") from err
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError(f"token file {str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; "
                              f"need 1-D integers")
    else:
        dtype = np.dtype(DTYPES[token_dtype])
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ConfigError(f"token file {str(path)!r} has {size} bytes, not a multiple of {dtype.itemsize} "
                              f"(data.token_dtype={token_dtype}); is it a token file of that dtype?")
        if size == 0:
            raise ConfigError(f"token file {str(path)!r} is empty")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) == 0:
        raise ConfigError(f"token file {str(path)!r} is empty")
    return tokens


def largest_id(tokens: np.ndarray) -> int:
    """The largest token id of a memory map, read in chunks (never whole)."""
    return id_range(tokens)[1]


def id_range(tokens: np.ndarray) -> tuple[int, int]:
    """The smallest and the largest token id of a memory map, in one pass of chunks (never
    whole); the smallest is 0 for unsigned dtypes (not looked for)."""
    lows, highs = [], []
    for i in range(0, len(tokens), _SCAN):
        chunk = tokens[i : i + _SCAN]
        highs.append(int(chunk.max()))
        if tokens.dtype.kind == "i":
            lows.append(int(chunk.min()))
    return min(lows, default=0), max(highs)


def first_negative(tokens: np.ndarray) -> tuple[int, int] | None:
    """(position, value) of the first negative id of a memory map, read in chunks; None when
    there is none (always for unsigned dtypes)."""
    if tokens.dtype.kind != "i":
        return None
    for i in range(0, len(tokens), _SCAN):
        below = np.flatnonzero(tokens[i : i + _SCAN] < 0)
        if len(below):
            return i + int(below[0]), int(tokens[i + int(below[0])])
    return None


def _sample_pairs(tokens: np.ndarray) -> np.ndarray:
    """Token pairs (k, 2) from the start, the middle and the end of a file (all of a small one),
    each window at an even offset: the two uint16 halves of what would be little-endian uint32s."""
    n = len(tokens) - len(tokens) % 2
    if n <= 3 * _SAMPLE:
        return np.asarray(tokens[:n]).reshape(-1, 2)
    starts = (0, (n - _SAMPLE) // 4 * 2, n - _SAMPLE)  # even, as n and _SAMPLE are
    return np.concatenate([np.asarray(tokens[s : s + _SAMPLE]) for s in starts]).reshape(-1, 2)


def looks_uint32(tokens: np.ndarray) -> int | None:
    """Whether a headerless file read as uint16 holds little-endian uint32 ids: ids below 2**16
    put a 0 at every odd position (ids below 2**18: 0..3), while in real uint16 text every other
    token is essentially never 0 (nor 256 of them all at most 3 while the others are not).
    Judged on a sample (:func:`_sample_pairs`).

    Returns:
        The number of token pairs sampled when it looks so, else None (also for an odd count of
        tokens, which no uint32 file has, and for fewer than 16 pairs).
    """
    if len(tokens) % 2:
        return None
    pairs = _sample_pairs(tokens)
    low, high = pairs[:, 0], pairs[:, 1]
    if len(pairs) < _MIN_PAIRS or not low.any():
        return None
    if not high.any():
        return len(pairs)
    high_halves = len(pairs) >= 16 * _MIN_PAIRS and int(high.max()) <= 3 < int(low.max())
    return len(pairs) if high_halves else None


def check_ids(path: Path, tokens: np.ndarray, token_dtype: str, vocab: int | None, where: str, fix: str) -> None:
    """Refuse a token file whose ids cannot be the model's: a negative id (a signed ``.npy``),
    one at or above `vocab`, or uint32 ids read as ``data.token_dtype=uint16``.

    Raises:
        ConfigError: naming the file, the first offending position and value, or the dtype to set.
    """
    low, top = id_range(tokens)
    if low < 0:
        at, value = first_negative(tokens) or (-1, low)
        raise ConfigError(f"token file {str(path)!r} holds a negative id: {value} at position {at} (of {len(tokens)}, "
                          f"{tokens.dtype}); token ids are 0..vocab_size - 1: rewrite the file without it")
    if vocab is not None and top >= vocab:
        raise ConfigError(f"token file {str(path)!r} holds id {top}, outside the model's vocabulary "
                          f"({where}={vocab}); {fix} >= {top + 1} or check data.token_dtype={token_dtype}")
    pairs = looks_uint32(tokens) if path.suffix != ".npy" and token_dtype == "uint16" else None
    if pairs is not None:
        raise ConfigError(f"token file {str(path)!r} looks like uint32 tokens read as data.token_dtype=uint16: in "
                          f"{pairs} sampled token pairs the second token is 0 (or at most 3), as the high half of a "
                          f"uint32 id is; set data.token_dtype=uint32")


class TokenStream:
    """Token files as one stream of their concatenated tokens, read by range (memory maps only).

    Args:
        files: the memory maps, in order.
        start, stop: the part of the concatenation this stream is (train or val).
    """

    def __init__(self, files: list[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        self.files = files
        self.offsets = np.cumsum([0] + [len(f) for f in files])  # file i holds [offsets[i], offsets[i + 1])
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self, at: int, n: int) -> np.ndarray:
        """Tokens [at, at + n) of this stream as int64 (copied: n tokens only)."""
        lo = self.start + at
        parts = []
        i = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        while n > 0:
            begin = lo - int(self.offsets[i])
            piece = self.files[i][begin : begin + n]
            parts.append(piece)
            lo, n, i = lo + len(piece), n - len(piece), i + 1
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)


def document_ids(x: Tensor, eos_id: int) -> Tensor:
    """Document ids of packed tokens: x (B, T) -> (B, T) long, +1 at every `eos_id` (the end of a
    document opens the next one: its position predicts the next document's first token alone)."""
    return (x == eos_id).long().cumsum(dim=1)


class TokenFileBatches(TokenBatches):
    """Random windows of a :class:`TokenStream`, drawn as :class:`pipeflow.data.synthetic.TokenBatches`
    draws them (same variable lengths: `chunks` micro-batches, each its own length); with
    `eos_id` x is ``(tokens, document ids)``."""

    labels = ("token-file-batch", "token-file-lengths")

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, seed: int,
                 lengths: tuple[int, int] | None = None, chunks: int = 1, eos_id: int | None = None) -> None:
        """Raises: ConfigError: T or B < 1, a stream shorter than T + 1 tokens, bad lengths or chunks."""
        super().__init__(stream, seq_len, batch_size, seed, lengths, chunks)
        self.eos_id = eos_id

    def windows(self, starts: Tensor) -> Tensor:
        """The B windows of T + 1 tokens, read from the memory maps (only they are copied)."""
        return torch.from_numpy(np.stack([self.tokens.read(s, self.seq_len + 1) for s in starts.tolist()]))

    def inputs(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """The tokens, or with `eos_id` the tokens and their document ids."""
        return x if self.eos_id is None else (x, document_ids(x, self.eos_id))


def model_vocab(model_cfg: Any) -> tuple[int | None, str]:
    """The model's vocabulary size and where it was read: ``model.vocab_size``, else the
    ``vocab_size`` of ``<model.path>/config.json`` (``model=hf``); None when neither says.

    Raises:
        ConfigError: that config.json is not JSON.
    """
    vocab = getattr(model_cfg, "vocab_size", None)
    if vocab is not None or not getattr(model_cfg, "path", None):
        return vocab, "model.vocab_size"
    file = Path(model_cfg.path) / "config.json"
    if not file.is_file():
        return None, "model.vocab_size"
    try:
        return json.loads(file.read_text()).get("vocab_size"), f"vocab_size in {file}"
    except json.JSONDecodeError as err:
        raise ConfigError(f"model.path's {str(file)!r} is not JSON ({err})") from err


def build_token_batches(cfg: Any, model_cfg: Any, lengths: tuple[int, int] | None,
                        chunks: int = 1) -> tuple[TokenFileBatches, TokenFileBatches]:
    """Train and validation batches of ``data.path``'s token files (validation: the last
    ``data.val_fraction`` of them, or ``data.eval_path``'s files whole), checked against the model's
    vocabulary (``model.vocab_size``, or model=hf's config.json; every file's ids are read
    once, in chunks, and a sample checked for uint32 ids read as uint16: :func:`check_ids`).

    Raises:
        ConfigError: no files, a bad file (see :func:`open_tokens`), a negative id, an id or
            ``data.eos_id`` outside the vocabulary, uint32 ids read as uint16 (:func:`check_ids`),
            ``pack_documents`` without ``eos_id``, a bad val_fraction.
    """
    if cfg.path is None:
        raise ConfigError("data=tokens needs data.path=<a token file, a folder of them or a glob>")
    vocab, where = model_vocab(model_cfg)
    fix = "set model.vocab_size" if where == "model.vocab_size" else "a model.path whose config has vocab_size"

    def checked(path: str, key: str) -> list[np.ndarray]:
        files = []
        for file in token_paths(path, key):
            tokens = open_tokens(file, cfg.token_dtype)
            check_ids(file, tokens, cfg.token_dtype, vocab, where, fix)
            files.append(tokens)
        return files

    files = checked(cfg.path, "data.path")
    eos = cfg.eos_id if cfg.pack_documents else None
    if cfg.pack_documents and eos is None:
        raise ConfigError("data.pack_documents=true needs data.eos_id (the id that ends each document)")
    if cfg.eos_id is not None and not (0 <= cfg.eos_id and (vocab is None or cfg.eos_id < vocab)):
        raise ConfigError(f"data.eos_id={cfg.eos_id} is outside the model's vocabulary "
                          f"({where}={vocab}): an id in 0..vocab_size - 1")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    total = TokenStream(files)
    eval_path = cfg.eval_path
    if eval_path is not None:  # a held-out file: data.path is trained on whole
        train, val = total, TokenStream(checked(eval_path, "data.eval_path"))
    else:
        cut = len(total) - int(math.floor(len(total) * cfg.val_fraction))
        train, val = TokenStream(files, 0, cut), TokenStream(files, cut)
    make = lambda stream, seed: TokenFileBatches(  # noqa: E731
        stream, cfg.seq_len, cfg.batch_size, seed, lengths, chunks, eos)
    return make(train, cfg.seed), make(val, cfg.seed + 1)
