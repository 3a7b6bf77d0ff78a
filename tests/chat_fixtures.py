"""A tiny chat tokenizer made locally (no download): a word-level ``tokenizers`` model wrapped in
``PreTrainedTokenizerFast`` with a jinja chat template, saved into a folder as a model's would be
(tokenizer.json, tokenizer_config.json, chat_template.jinja), and a few conversations."""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<unk>"]
WORDS = "hello hi how are you fine thanks what is two plus three five bye ok sure be brief tell me a joke no".split()
END = "<|end|>"  # each turn's end-of-turn token

# The template marks assistant output with {% generation %} (return_assistant_tokens_mask reads
# it); system turns pass, any other role is refused (raise_exception), as real templates do.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% else %}{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
PLAIN_TEMPLATE = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "fine thanks"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus three"},
     {"role": "assistant", "content": "five"}, {"role": "user", "content": "thanks"},
     {"role": "assistant", "content": "sure"}],
    [{"role": "user", "content": "tell me a joke"}, {"role": "assistant", "content": "no"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi how are you"},
     {"role": "user", "content": "fine bye"}, {"role": "assistant", "content": "bye"}],
]


def write_tokenizer(folder: str | Path, markers: bool = True) -> Path:
    """Save the tiny tokenizer with the chat template (with or without generation markers) into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE if markers else PLAIN_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return Path(folder)


def write_jsonl(path: str | Path, conversations: list = CONVERSATIONS, extra: list | None = None) -> Path:
    """Conversations as ``{"messages": [...]}`` lines (plus `extra` raw rows)."""
    rows = [{"messages": c} for c in conversations] + list(extra or [])
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)
