"""Marked conversations (:mod:`pipeflow.data.chat`) as training rows for ``data=chat``.

A conversation of L tokens gives L - 1 positions: inputs its tokens but the last, targets its
tokens but the first, a target kept where its token is trained (an assistant turn's) and -100
(masked) elsewhere.  With ``data.pack_documents`` (the default of ``data=chat``) whole
conversations are packed in order into rows of ``data.seq_len`` positions with their document
ids (0, 1, ... within a row; the padding at a row's end its own), so attention never crosses
conversations; without, each row holds one.  A conversation longer than a row is dropped,
truncated or refused as ``data.overlong`` says, and counted in the summary.

Batch `step` is rows of an epoch-wise permutation drawn from (``data.seed``, epoch) alone:
every rank reads the same batch, every row once per epoch.  ``python -m pipeflow.data.prepare
--chat`` writes the tokenised conversations once (:func:`save_conversations`), and ``data.path``
may name that folder instead of the conversation files.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeflow.errors import ChatDataError, ConfigError

log = logging.getLogger("pipeflow")

OVERLONG = ("drop", "truncate", "error")
FILES = {"tokens": "chat_tokens.npy", "trained": "chat_trained.npy", "starts": "chat_starts.npy"}


@dataclass
class Conversations:
    """Tokenised conversations: their tokens end to end, each token's trained mark, and where
    each begins (conversation c is ``tokens[starts[c]:starts[c + 1]]``)."""

    tokens: np.ndarray
    trained: np.ndarray
    starts: np.ndarray
    sources: list[str] | None = None  # where each was read (file:line), for messages

    def __len__(self) -> int:
        return len(self.starts) - 1

    def part(self, lo: int, hi: int) -> "Conversations":
        """Conversations lo .. hi - 1."""
        a, b = int(self.starts[lo]), int(self.starts[hi])
        return Conversations(self.tokens[a:b], self.trained[a:b], self.starts[lo : hi + 1] - a,
                             None if self.sources is None else self.sources[lo:hi])

    def where(self, c: int) -> str:
        """Where conversation c was read (or its number)."""
        return self.sources[c] if self.sources is not None else f"conversation {c}"


def tokenize_conversations(paths: list[Path], tokenizer: Any, progress: bool = False) -> Conversations:
    """Every conversation of the files, tokenised and marked (:func:`pipeflow.data.chat.tokenize_conversation`).

    Raises:
        ChatDataError: a bad row or a conversation the template refuses; no conversation at all.
    """
    from pipeflow.data.chat import has_generation_markers, read_conversations, tokenize_conversation

    marked = has_generation_markers(tokenizer)
    tokens: list[int] = []
    trained: list[bool] = []
    starts, sources = [0], []
    rows = read_conversations(paths)
    if progress:
        from tqdm import tqdm

        rows = tqdm(rows, desc="tokenizing", unit=" conversations")
    for where, messages in rows:
        ids, marks = tokenize_conversation(tokenizer, messages, where, marked)
        tokens += ids
        trained += marks
        starts.append(len(tokens))
        sources.append(where)
    if not sources:
        raise ChatDataError(f"the files {[str(p) for p in paths]} hold no conversation")
    dtype = np.uint16 if max(tokens, default=0) < 1 << 16 else np.uint32
    return Conversations(np.asarray(tokens, dtype), np.asarray(trained, bool), np.asarray(starts, np.int64), sources)


def save_conversations(conversations: Conversations, out: Path) -> None:
    """Write the tokens, marks and starts as ``.npy`` files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for field, name in FILES.items():
        np.save(out / name, getattr(conversations, field))


def load_conversations(folder: Path) -> Conversations | None:
    """The conversations ``prepare --chat`` wrote into `folder`; None when it holds none."""
    if not all((folder / name).is_file() for name in FILES.values()):
        return None
    return Conversations(*(np.load(folder / name) for name in FILES.values()))


def summary_of(conversations: Conversations) -> dict[str, int]:
    """Counts of the conversations: how many, their tokens, the trained ones."""
    lengths = np.diff(conversations.starts)
    return {"conversations": len(conversations), "tokens": int(lengths.sum()),
            "trained_tokens": int(conversations.trained.sum()),
            "without_assistant": int(sum(not conversations.trained[a:b].any()
                                         for a, b in zip(conversations.starts[:-1], conversations.starts[1:])))}


@dataclass
class Rows:
    """Packed rows (R, T): input tokens, document ids, targets (-100 where masked)."""

    inputs: Tensor
    documents: Tensor
    targets: Tensor


def pack_rows(conversations: Conversations, seq_len: int, overlong: str = "drop", pad_id: int = 0,
              pack: bool = True) -> tuple[Rows, dict[str, int]]:
    """Rows of `seq_len` positions (see the module docstring) and counts: ``rows``, ``dropped``
    and ``truncated`` (longer than seq_len + 1 tokens), ``targets`` (trained ones).

    Raises:
        ChatDataError: a conversation too long with ``overlong="error"``, or none left.
        ConfigError: an unknown `overlong`.
    """
    if overlong not in OVERLONG:
        raise ConfigError(f"data.overlong={overlong!r} is unknown; use one of {', '.join(OVERLONG)}")
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    fill, dropped, truncated = seq_len + 1, 0, 0  # fill > seq_len: open a row first
    for c in range(len(conversations)):
        a, b = int(conversations.starts[c]), int(conversations.starts[c + 1])
        if b - a < 2:
            continue  # one token: nothing to predict
        if b - a - 1 > seq_len:
            if overlong == "error":
                raise ChatDataError(f"{conversations.where(c)}: a conversation of {b - a} tokens is longer than a "
                                    f"row (data.seq_len={seq_len} positions, {seq_len + 1} tokens); set "
                                    f"data.overlong=drop or truncate, or a larger data.seq_len")
            if overlong == "drop":
                dropped += 1
                continue
            b, truncated = a + seq_len + 1, truncated + 1
        piece = (conversations.tokens[a:b].astype(np.int64), conversations.trained[a:b])
        if not pack or fill + (b - a - 1) > seq_len:
            rows.append([])
            fill = 0
        rows[-1].append(piece)
        fill += b - a - 1
    if not rows:
        raise ChatDataError(f"no conversation fits data.seq_len={seq_len} (data.overlong={overlong} dropped {dropped})")
    packed = Rows(*(torch.empty(len(rows), seq_len, dtype=torch.long) for _ in range(3)))
    for r, pieces in enumerate(rows):
        _fill_row(packed, r, pieces, pad_id)
    counts = {"rows": len(rows), "dropped": dropped, "truncated": truncated,
              "targets": int((packed.targets != -100).sum())}
    return packed, counts


def _fill_row(rows: Rows, r: int, pieces: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> None:
    """Row r from its conversations, padded (its own document, targets masked)."""
    at = 0
    for doc, (ids, trained) in enumerate(pieces):
        n = len(ids) - 1
        rows.inputs[r, at : at + n] = torch.from_numpy(ids[:-1])
        rows.targets[r, at : at + n] = torch.from_numpy(np.where(trained[1:], ids[1:], -100))
        rows.documents[r, at : at + n] = doc
        at += n
    rows.inputs[r, at:], rows.targets[r, at:], rows.documents[r, at:] = pad_id, -100, len(pieces)


class ChatBatches:
    """Batches of packed rows: batch `step` holds rows ``step * B .. (step + 1) * B - 1`` of the
    endless sequence of epochs, each epoch a permutation of the rows drawn from (seed, epoch).

    Args:
        rows: the packed rows.
        batch_size: B rows a batch.
        seed: the data seed.
        pack: inputs are ``(tokens, document ids)`` (else the tokens alone).
    """

    def __init__(self, rows: Rows, batch_size: int, seed: int, pack: bool = True) -> None:
        if batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size} must be >= 1")
        self.rows, self.batch_size, self.seed, self.pack = rows, batch_size, seed, pack
        self._epoch: tuple[int, Tensor] | None = None

    def _order(self, epoch: int) -> Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(len(self.rows.inputs), generator=gen))
        return self._epoch[1]

    def get(self, step: int) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor]:
        """Batch `step`: (inputs (B, T) or (tokens, document ids), targets (B, T)), on the host."""
        return self.take(step, step * self.batch_size, self.batch_size)

    def take(self, step: int, start: int, count: int) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor]:
        """Rows ``start .. start + count - 1`` of the endless sequence (``train.batch_ramp``: a
        step's rows follow the samples consumed before it)."""
        n = len(self.rows.inputs)
        picks = [int(self._order(k // n)[k % n]) for k in range(start, start + count)]
        index = torch.tensor(picks)
        x, y = self.rows.inputs[index], self.rows.targets[index]
        return ((x, self.rows.documents[index]) if self.pack else x), y


def build_chat_batches(cfg: Any, model_cfg: Any) -> tuple[ChatBatches, ChatBatches]:
    """Train and validation batches of ``data.path``'s conversations (the last
    ``data.val_fraction`` of them held out, all of them trained when that leaves none; or, with
    ``data.eval_path``, those conversations held out and ``data.path``'s all trained), tokenised with
    ``data.tokenizer`` or ``model.path``'s tokenizer, or read from a ``prepare --chat`` folder.
    Logs the counts (conversations, rows, dropped and truncated ones, trained targets).

    Raises:
        ChatDataError, ConfigError: no path or tokenizer, a bad row, ids outside the model's
            vocabulary, variable lengths (rows are packed to data.seq_len).
    """
    from pipeflow.data.tokens import model_vocab

    if cfg.path is None:
        raise ConfigError("data=chat needs data.path=<a .jsonl/.parquet file of conversations, a folder or glob of "
                          "them, or a folder from python -m pipeflow.data.prepare --chat>")
    if cfg.variable_lengths:
        raise ConfigError("data=chat packs conversations into rows of data.seq_len: set data.variable_lengths=false")
    conversations, pad_id = _conversations(cfg.path, cfg, model_cfg)
    eval_path = cfg.eval_path
    held_out = _conversations(eval_path, cfg, model_cfg, "data.eval_path")[0] if eval_path is not None else None
    vocab, where = model_vocab(model_cfg)
    top = max(int(c.tokens.max()) for c in (conversations, held_out) if c is not None)
    if vocab is not None and top >= vocab:
        raise ConfigError(f"data=chat: token id {top} is outside the model's vocabulary ({where}={vocab}); use the "
                          f"model's own tokenizer")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    whole = conversations
    if held_out is None:  # the last val_fraction of data.path's
        cut = len(whole) - int(len(whole) * cfg.val_fraction)
        conversations, held_out = whole.part(0, cut), whole.part(cut, len(whole))
    train, train_counts = pack_rows(conversations, cfg.seq_len, cfg.overlong, pad_id, cfg.pack_documents)
    if not train_counts["targets"]:
        raise ChatDataError(_no_training_target(conversations, cfg))
    val, counts = train, {**summary_of(whole), **train_counts, "held_out": len(held_out)}
    if len(held_out):
        val, val_counts = pack_rows(held_out, cfg.seq_len, cfg.overlong, pad_id, cfg.pack_documents)
        counts.update({f"held_out_{k}": v for k, v in val_counts.items() if k in ("rows", "targets")},
                      dropped=counts["dropped"] + val_counts["dropped"],
                      truncated=counts["truncated"] + val_counts["truncated"])
    log.info("data=chat: %s", json.dumps(counts))
    if counts["dropped"] or counts["truncated"]:
        log.warning("data=chat: %d conversations longer than data.seq_len=%d dropped, %d truncated "
                    "(data.overlong=%s)", counts["dropped"], cfg.seq_len, counts["truncated"], cfg.overlong)
    return (ChatBatches(train, cfg.batch_size, cfg.seed, cfg.pack_documents),
            ChatBatches(val, cfg.batch_size, cfg.seed + 1, cfg.pack_documents))


def _no_training_target(conversations: Conversations, cfg: Any) -> str:
    """Why the trained conversations of ``data.path`` leave nothing to learn: no assistant turn in
    them, or none within the rows ``data.seq_len`` and ``data.overlong`` make of them."""
    where = f"data=chat: the {len(conversations)} trained conversations of data.path={cfg.path}"
    if not conversations.trained.any():
        return (f"{where} have no assistant turn: every token is prompt, masked, so there is nothing to train; add "
                f"assistant replies (the turns a model learns to write)")
    return (f"{where} keep no assistant token in rows of data.seq_len={cfg.seq_len} (data.overlong={cfg.overlong} "
            f"drops or cuts every answer): raise data.seq_len, or shorten the prompts")


def _conversations(path: str, cfg: Any, model_cfg: Any, key: str = "data.path") -> tuple[Conversations, int]:
    """The conversations `path` (config `key`'s value) names, prepared or tokenised now, and the
    padding id."""
    from pipeflow.data.chat import conversation_paths, load_chat_tokenizer

    folder = Path(path)
    prepared = load_conversations(folder) if folder.is_dir() else None
    source = cfg.tokenizer or getattr(model_cfg, "path", None)
    if prepared is not None:
        meta = json.loads((folder / "prepare.json").read_text()) if (folder / "prepare.json").is_file() else {}
        return prepared, int(meta.get("pad_id", 0))
    if source is None:
        raise ConfigError("data=chat tokenises with the model's tokenizer and chat template: set model.path "
                          "(model=hf) or data.tokenizer=<a Hugging Face folder with them>")
    tokenizer = load_chat_tokenizer(source)
    return tokenize_conversations(conversation_paths(path, key), tokenizer), pad_id_of(tokenizer)


def pad_id_of(tokenizer: Any) -> int:
    """The id padding takes (masked, its own document): the pad token's, else end-of-text's, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0
