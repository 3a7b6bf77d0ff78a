"""Tokenize a local corpus into token shards for ``data=tokens``:

    python -m pipeflow.data.prepare corpus.txt docs.jsonl --tokenizer tokenizer.json --out data/tok

Text files are one document each; ``.jsonl`` files one document per line (``--text-key``);
``.parquet`` files where the ``datasets`` library is installed.  Documents are separated by the
tokenizer's end-of-document token; shards are ``.npy`` arrays (uint16 when the vocabulary fits,
else uint32) of ``--shard-tokens`` tokens, the last one shorter.  ``--train-tokenizer V`` first
trains a byte-level BPE tokenizer of V tokens on the corpus itself (offline, for tests and
examples) and writes it to ``<out>/tokenizer.json``.  Imports ``tokenizers`` (and ``tqdm``) only
when run.

``--chat`` reads conversations instead (``{"messages": [{"role": ..., "content": ...}, ...]}``
rows of ``.jsonl``/``.parquet`` files), tokenised with the chat template of ``--tokenizer <a
Hugging Face folder>`` (the model's), and writes tokens, per-token trained marks (assistant
turns) and conversation starts for ``data=chat data.path=<out>`` (pipeflow/data/chat_rows.py):

    python -m pipeflow.data.prepare --chat chats.jsonl --tokenizer /models/my-llama --out data/chat
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeflow.errors import ConfigError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


def documents(paths: list[Path], text_key: str = "text") -> Iterator[str]:
    """The documents of the corpus files, in order: a text file is one document, a ``.jsonl``
    line one, a ``.parquet`` row one (with ``datasets``).

    Raises:
        ConfigError: a missing file, a jsonl line that is not JSON or lacks `text_key`, parquet
            without ``datasets``.
    """
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"corpus file {str(path)!r} does not exist")
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as lines:
                for n, line in enumerate(lines, 1):
                    if line.strip():
                        yield _json_text(line, path, n, text_key)
        elif path.suffix == ".parquet":
            yield from _parquet_texts(path, text_key)
        else:
            yield path.read_text(encoding="utf-8")


def _json_text(line: str, path: Path, n: int, key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{n} is not a JSON line ({err})") from err
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ConfigError(f"{path}:{n} has no string field {key!r}; set --text-key")
    return record[key]


def _parquet_texts(path: Path, key: str) -> Iterator[str]:
    try:
        import datasets  # optional: only parquet needs it
    except ImportError as err:
        raise ConfigError(f"{path} is parquet, which needs the `datasets` library (pip install datasets)") from err
    table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    if key not in table.column_names:
        raise ConfigError(f"{path} has no column {key!r} (columns: {table.column_names}); set --text-key")
    yield from table[key]


def load_tokenizer(where: str | Path, eos: str | None = None) -> tuple[Any, int]:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json or a local Hugging Face folder, and its
    end-of-document id: `eos`'s, else the folder's tokenizer_config.json ``eos_token``, else a
    usual name.

    Raises:
        ConfigError: no tokenizer.json there, `eos` not a token, or no end-of-document token found.
    """
    from tokenizers import Tokenizer

    where = Path(where)
    file = where / "tokenizer.json" if where.is_dir() else where
    if not file.is_file():
        raise ConfigError(f"--tokenizer {str(where)!r}: no tokenizer.json there")
    tokenizer = Tokenizer.from_file(str(file))
    if eos is not None:
        return tokenizer, _eos_id(tokenizer, eos)
    names = list(EOS_CANDIDATES)
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        names = ([eos] if isinstance(eos, str) else []) + names
    for name in names:
        if (eos_id := tokenizer.token_to_id(name)) is not None:
            return tokenizer, eos_id
    raise ConfigError(f"tokenizer {str(file)!r} has none of the end-of-document tokens {names}; "
                      f"pass --eos <its token>")


def train_tokenizer(paths: list[Path], vocab_size: int, text_key: str = "text") -> Any:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on the corpus (offline), with
    ``<|endoftext|>`` as its end-of-document token.

    Raises:
        ConfigError: vocab_size too small for the 256 bytes and the special token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 257 tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents(paths, text_key), trainer=trainer)
    return tokenizer


def prepare(paths: list[Path], tokenizer: Any, eos_id: int, out: Path, shard_tokens: int = 100_000_000,
            text_key: str = "text", progress: bool = True) -> dict[str, Any]:
    """Tokenize the corpus into ``out/shard_00000.npy``, ... (the end-of-document id after every
    document) and write ``out/prepare.json``; returns its summary.

    Raises:
        ConfigError: shard_tokens < 1, an empty corpus, or a bad corpus file.
    """
    from tqdm import tqdm

    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens={shard_tokens} must be >= 1")
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    buffer, filled, shards, docs, total = np.empty(shard_tokens, dtype), 0, 0, 0, 0
    for text in tqdm(documents(paths, text_key), desc="tokenizing", unit=" docs", disable=not progress):
        ids = np.asarray(tokenizer.encode(text).ids + [eos_id], dtype=dtype)
        docs, total = docs + 1, total + len(ids)
        while len(ids):
            take = min(len(ids), shard_tokens - filled)
            buffer[filled : filled + take], filled, ids = ids[:take], filled + take, ids[take:]
            if filled == shard_tokens:
                np.save(out / f"shard_{shards:05d}.npy", buffer)
                shards, filled = shards + 1, 0
    if docs == 0:
        raise ConfigError(f"the corpus {[str(p) for p in paths]} holds no document")
    if filled:
        np.save(out / f"shard_{shards:05d}.npy", buffer[:filled])
        shards += 1
    summary = {"documents": docs, "tokens": total, "shards": shards, "dtype": np.dtype(dtype).name,
               "vocab_size": vocab, "eos_id": eos_id}
    (out / "prepare.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); prints a summary line and the data keys."""
    parser = argparse.ArgumentParser(prog="python -m pipeflow.data.prepare",
                                     description="Tokenize local text/jsonl (parquet with `datasets`) files into "
                                                 ".npy token shards for data=tokens.")
    parser.add_argument("files", nargs="+", type=Path, help="text files (one document each), .jsonl, .parquet")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the shards to")
    parser.add_argument("--tokenizer", help="a tokenizer.json or a local Hugging Face folder holding one")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                        help="train a byte-level BPE of this many tokens on the corpus (written to OUT/tokenizer.json)")
    parser.add_argument("--eos", help="the end-of-document token (default: the tokenizer's own, or a usual name)")
    parser.add_argument("--text-key", default="text", help="the text field of jsonl/parquet records (default: text)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--chat", action="store_true",
                        help="the files hold conversations (messages rows): tokenise them with --tokenizer's chat "
                             "template, assistant turns marked trained, for data=chat")
    args = parser.parse_args(argv)
    if args.chat:
        return _main_chat(args)
    try:
        tokenizer, eos_id = _tokenizer(args)
        summary = prepare(args.files, tokenizer, eos_id, args.out, args.shard_tokens, args.text_key,
                          not args.no_progress)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    docs, shards = summary["documents"], summary["shards"]
    print(f"prepared {docs} document{'s' * (docs != 1)}, {summary['tokens']} tokens, {shards} "
          f"shard{'s' * (shards != 1)} ({summary['dtype']}) in {args.out}; train with: data=tokens "
          f"data.path={args.out} data.eos_id={eos_id} and a model of at least {summary['vocab_size']} tokens "
          f"(model.vocab_size={summary['vocab_size']} for model=gpt; model=hf reads its config.json)")
    return 0


def prepare_chat(paths: list[Path], tokenizer_folder: str | Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """Tokenise conversations with the folder's chat template into `out` (tokens, trained marks,
    starts: :func:`pipeflow.data.chat_rows.save_conversations`) and write ``out/prepare.json``;
    returns its summary.

    Raises:
        ChatDataError: a bad row, a role the template refuses, no tokenizer or template there.
    """
    from pipeflow.data.chat import conversation_paths, load_chat_tokenizer
    from pipeflow.data.chat_rows import pad_id_of, save_conversations, summary_of, tokenize_conversations

    tokenizer = load_chat_tokenizer(tokenizer_folder)
    files = [p for path in paths for p in conversation_paths(path)]
    conversations = tokenize_conversations(files, tokenizer, progress)
    save_conversations(conversations, out)
    summary = {"format": "chat", **summary_of(conversations), "vocab_size": len(tokenizer),
               "pad_id": pad_id_of(tokenizer), "tokenizer": str(tokenizer_folder)}
    (out / "prepare.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _main_chat(args: argparse.Namespace) -> int:
    """``--chat``: conversations into a data=chat folder; prints the summary line."""
    if args.tokenizer is None:
        print("error: --chat needs --tokenizer <the model's Hugging Face folder, with its chat template>",
              file=sys.stderr)
        return 2
    try:
        summary = prepare_chat(args.files, args.tokenizer, args.out, not args.no_progress)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"prepared {summary['conversations']} conversations, {summary['tokens']} tokens "
          f"({summary['trained_tokens']} trained: assistant turns) in {args.out}; train with: data=chat "
          f"data.path={args.out} model=hf model.path={args.tokenizer}")
    return 0


def _tokenizer(args: argparse.Namespace) -> tuple[Any, int]:
    if (args.tokenizer is None) == (args.train_tokenizer is None):
        raise ConfigError("give exactly one of --tokenizer <tokenizer.json or folder> and --train-tokenizer VOCAB_SIZE")
    if args.train_tokenizer is not None:
        tokenizer = train_tokenizer(args.files, args.train_tokenizer, args.text_key)
        args.out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(args.out / "tokenizer.json"))
        return tokenizer, _eos_id(tokenizer, args.eos or "<|endoftext|>")
    return load_tokenizer(args.tokenizer, args.eos)


def _eos_id(tokenizer: Any, eos: str) -> int:
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise ConfigError(f"--eos {eos!r} is not a token of the tokenizer")
    return eos_id


if __name__ == "__main__":
    sys.exit(main())
