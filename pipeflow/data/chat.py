"""Conversations for supervised fine-tuning (``data=chat``): JSONL or Parquet rows in the common
``messages`` form (``[{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]``),
tokenised with the model's own tokenizer and chat template (``AutoTokenizer.from_pretrained(
model.path).apply_chat_template``).

Each token is marked trained or not: the assistant turns are trained, each with its end-of-turn
token (so a model learns to stop), everything else (system, user, tool turns, the template's
own headers) is not.  The marks come from the template's own assistant mask where it has
``{% generation %}`` markers (``return_assistant_tokens_mask``), else from tokenising the
conversation up to each assistant turn (with the generation prompt) and up to its end: the
tokens between the two are the turn.  Packing the marked conversations into rows is
:mod:`pipeflow.data.chat_rows`'s business.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeflow.data.tokens import matching_files
from pipeflow.errors import ChatDataError

SUFFIXES = (".jsonl", ".parquet")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def conversation_paths(path: str | Path, key: str = "data.path") -> list[Path]:
    """The conversation files `path` (config `key`'s value) names: a file, a folder (its ``.jsonl``
    and ``.parquet`` files) or a glob, in name order.

    Raises:
        ChatDataError: no file matches.
    """
    text = str(path)
    found = matching_files(text, SUFFIXES)
    if not found:
        raise ChatDataError(f"{key}={text!r} names no conversation file (.jsonl or .parquet, or a folder of "
                            f"them, or a folder that `python -m pipeflow.data.prepare --chat` wrote)")
    return found


def read_conversations(paths: list[Path]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(where, messages) of every row of the files, in order; `where` names the file and line
    (``chat.jsonl:3``) or row (``chat.parquet row 3``).

    Raises:
        ChatDataError: a line that is not JSON, a row without a list of messages, a message
            without a string ``role`` or without ``content``; parquet without ``datasets``.
    """
    for path in paths:
        if path.suffix == ".parquet":
            for n, row in enumerate(_parquet_rows(path), 1):
                yield _messages(row, f"{path} row {n}")
            continue
        with path.open(encoding="utf-8") as lines:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ChatDataError(f"{path}:{n} is not a JSON line ({err})") from err
                yield _messages(row, f"{path}:{n}")


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import datasets  # the hf extra: a well-kept parquet reader
    except ImportError as err:
        raise ChatDataError(f"{path} is parquet, which needs the `datasets` library "
                            f"(pip install 'pipeflow[hf]')") from err
    yield from datasets.load_dataset("parquet", data_files=str(path), split="train")


ROLES = ("system", "user", "assistant", "tool")  # what chat templates take


def _messages(row: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    """The row's messages, checked: a list of {role, content} dicts."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ChatDataError(f"{where}: no conversation: a row needs \"messages\": [{{\"role\": ..., "
                            f"\"content\": ...}}, ...] (a non-empty list); this row has {keys}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ChatDataError(f"{where}: message {k} is {message!r}; each message needs a string \"role\" and a "
                                f"\"content\"")
        if message["role"] not in ROLES:  # a misspelt "assistant" would be masked: trained on nothing, silently
            raise ChatDataError(f"{where}: message {k} has role {message['role']!r}; the roles are "
                                f"{', '.join(ROLES)} (only assistant turns are trained)")
        if not isinstance(message["content"], (str, list)):
            raise ChatDataError(f"{where}: message {k} ({message['role']}) has content {message['content']!r}; "
                                f"a message's content is text")
    return where, messages


def load_chat_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a local Hugging Face folder (``model.path``), with its chat template.

    Raises:
        ChatDataError: no tokenizer there, or one without a chat template.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise ChatDataError(f"data=chat: no tokenizer in {str(folder)!r} ({err}); point model.path (or "
                            f"data.tokenizer) at a Hugging Face folder with tokenizer files") from err
    if not getattr(tokenizer, "chat_template", None):
        raise ChatDataError(f"data=chat: the tokenizer in {str(folder)!r} has no chat template (chat_template.jinja "
                            f"or tokenizer_config.json's chat_template); use a chat model's tokenizer")
    return tokenizer


def has_generation_markers(tokenizer: Any) -> bool:
    """True when the chat template marks assistant output with ``{% generation %}``."""
    template = tokenizer.chat_template
    templates = template.values() if isinstance(template, dict) else [template]
    return any(GENERATION_MARKER.search(t) for t in templates)


def _ids(encoded: Any) -> list[int]:
    """Token ids of ``apply_chat_template(tokenize=True)``: a list, or a mapping holding one."""
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


def _render(tokenizer: Any, messages: list[dict[str, Any]], where: str, **kwargs: Any) -> Any:
    """``apply_chat_template`` on `messages`, tokenised; a template's refusal named.

    Raises:
        ChatDataError: the template raised (a role it does not take, roles out of order).
    """
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except TemplateError as err:
        roles = [m["role"] for m in messages]
        raise ChatDataError(f"{where}: the chat template refuses this conversation (roles {roles}): {err}; drop or "
                            f"rewrite such rows (system and tool roles pass only where the template takes "
                            f"them)") from err


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]], where: str,
                          marked: bool | None = None) -> tuple[list[int], list[bool]]:
    """A conversation as token ids and, per token, whether it is trained (an assistant turn's).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: the conversation.
        where: the file and line, for errors.
        marked: the template has ``{% generation %}`` markers (default: looked up).

    Raises:
        ChatDataError: the template refuses the conversation, or (without markers) renders a
            conversation's beginning otherwise than its whole (add markers to such a template).
    """
    marked = has_generation_markers(tokenizer) if marked is None else marked
    if marked:
        encoded = _render(tokenizer, messages, where, return_dict=True, return_assistant_tokens_mask=True)
        return _ids(encoded), [bool(v) for v in encoded["assistant_masks"]]
    ids = _ids(_render(tokenizer, messages, where))
    trained = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _prompt_before(tokenizer, messages[:i], where)
        through = _ids(_render(tokenizer, messages[: i + 1], where))
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise ChatDataError(f"{where}: the chat template renders the conversation up to assistant turn {i} "
                                f"otherwise than the whole conversation, so the turn's tokens cannot be found; give "
                                f"the template {{% generation %}} markers around assistant content")
        trained[len(before) : len(through)] = [True] * (len(through) - len(before))
    return ids, trained


def _prompt_before(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> list[int]:
    """The tokens before an assistant turn: `messages` rendered with the generation prompt (the
    turn's header); for a conversation that opens with the assistant, the header alone where the
    template renders no messages, else nothing."""
    if messages:
        return _ids(_render(tokenizer, messages, where, add_generation_prompt=True))
    try:
        return _ids(_render(tokenizer, messages, where, add_generation_prompt=True))
    except (ChatDataError, IndexError, KeyError, TypeError):  # a template that needs a message
        return []
