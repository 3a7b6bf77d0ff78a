#!/usr/bin/env bash
# LoRA fine-tuning end to end, offline on the CPU in about a minute (needs pipeflow[hf]):
#
#   0. a base model to fine-tune: the tiny random Llama of configs/hf/llama_tiny saved with a small
#      word-level tokenizer and a chat template (the stand-in for the Llama/Mistral/Qwen you have)
#   1. what the base model answers before fine-tuning (python -m pipeflow.generate), while the
#      conversations become tokens and trained marks (python -m pipeflow.data.prepare --chat)
#   2. LoRA fine-tune on 2 pipeline ranks, base frozen (model=hf model.lora.rank=8 data=chat),
#      then the same questions to the fine-tuned model (pipeflow.generate train.resume=<the run>)
#   3. export the adapters for peft, and the merged weights for transformers
#                                                     (python -m pipeflow.checkpoint export --format peft
#                                                      / --format hf --merge-lora)
#   4. load both (PeftModel.from_pretrained on the base; AutoModelForCausalLM.from_pretrained on the
#      merged folder), check that they give the same logits and the pipeline's answer, and print
#      the answers before and after
#
#   examples/finetune_lora.sh                       # writes under outputs/finetune_lora_<time>
#   WORK=/tmp/ft STEPS=20 examples/finetune_lora.sh schedule=zb_h1   # more train.py overrides follow
#
# Settings (environment): WORK (the folder to write), STEPS (default 200), PYTHON.  Point BASE at a
# folder of your own (config.json, *.safetensors, a tokenizer with a chat template) and CHAT at your
# conversations (JSONL of {"messages": [{"role": ..., "content": ...}, ...]}) to run steps 1-4 on them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
WORK=${WORK:-outputs/finetune_lora_$(date +%Y-%m-%d_%H-%M-%S)}
STEPS=${STEPS:-200}
mkdir -p "$WORK"

if [ -z "${BASE:-}" ]; then
    BASE="$WORK/base"
    echo "== 0. a base model with a chat template -> $BASE, conversations -> $WORK/chat.jsonl"
    "$PYTHON" - "$BASE" "$WORK/chat.jsonl" <<'EOF'
import json
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

base, chat = sys.argv[1], sys.argv[2]
special = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
words = "hello hi how are you fine thanks what is two plus three four five six one bye ok".split()
vocab = {t: i for i, t in enumerate(special + words)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
tokenizer.chat_template = (  # assistant output marked for return_assistant_tokens_mask
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
tokenizer.save_pretrained(base)
config = AutoConfig.from_pretrained("configs/hf/llama_tiny")
config.eos_token_id = [vocab["<eos>"], vocab["<|end|>"]]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained(base)  # the "pre-trained" weights LoRA adapts
sums = [("one", "two", "three"), ("two", "two", "four"), ("two", "three", "five"), ("three", "three", "six"),
        ("one", "three", "four"), ("one", "one", "two"), ("three", "two", "five"), ("two", "four", "six")]
with open(chat, "w") as f:
    for k in range(64):
        a, b, c = sums[k % len(sums)]
        messages = [{"role": "user", "content": f"what is {a} plus {b}"}, {"role": "assistant", "content": c}]
        if k % 3 == 0:
            messages = [{"role": "user", "content": "hello how are you"},
                        {"role": "assistant", "content": "fine thanks"}] + messages
        f.write(json.dumps({"messages": messages}) + "\n")
print(f"base: {sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters()):,} parameters, "
      f"tokenizer of {len(tokenizer)} tokens; 64 conversations")
EOF
    CHAT=${CHAT:-$WORK/chat.jsonl}
fi

printf '%s\n' "what is two plus three" "what is one plus one" "hello how are you" > "$WORK/questions.txt"
ASK=(generate.prompts="$WORK/questions.txt" generate.chat=true generate.max_new_tokens=4)  # greedy
echo "== 1. before fine-tuning, the base model answers (pipeflow.generate -> $WORK/before.jsonl);"
echo "      meanwhile prepare --chat: tokens and trained marks -> $WORK/chat"
# one process holds this small base whole; for a base that needs the pipeline, launch it as 2b does
"$PYTHON" -m pipeflow.generate model=hf model.path="$BASE" "${ASK[@]}" generate.output="$WORK/before.jsonl" \
    > "$WORK/before.log" 2>&1 &
ASKING=$!
"$PYTHON" -m pipeflow.data.prepare --chat --tokenizer "$BASE" --out "$WORK/chat" --no-progress "$CHAT"
wait "$ASKING" || { cat "$WORK/before.log"; exit 1; }
cat "$WORK/before.jsonl"

echo "== 2. LoRA fine-tune on 2 pipeline ranks (base frozen), $STEPS steps"
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 train.py \
    model=hf model.path="$BASE" model.lora.rank=8 model.lora.alpha=16 'model.lora.targets=[q_proj,v_proj,o_proj]' \
    data=chat data.path="$WORK/chat" data.seq_len=32 data.batch_size=8 data.val_fraction=0.1 \
    parallel.pp=2 pipeline.num_microbatches=4 optim.lr=5e-2 optim.warmup_steps=10 \
    train.max_steps="$STEPS" train.log_every=50 train.eval_every=0 train.save_every="$STEPS" \
    train.run_dir="$WORK/run" "$@"

echo "== 2b. after fine-tuning: the run's checkpoint answers on 2 pipeline ranks (its config.yaml read)"
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeflow.generate \
    train.resume="$WORK/run" "${ASK[@]}" generate.output="$WORK/after.jsonl"

echo "== 3. export: adapters for peft -> $WORK/adapter, merged weights -> $WORK/merged"
"$PYTHON" -m pipeflow.checkpoint export --format peft "$WORK/run/checkpoints" "$WORK/adapter"
"$PYTHON" -m pipeflow.checkpoint export --format hf --merge-lora "$WORK/run/checkpoints" "$WORK/merged"

echo "== 4. load both with transformers and peft"
"$PYTHON" - "$BASE" "$WORK" <<'EOF'
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

logging.disable_progress_bar()
base, work = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(base)
adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), f"{work}/adapter").eval()
merged = AutoModelForCausalLM.from_pretrained(f"{work}/merged").eval()
ids = tokenizer.apply_chat_template([{"role": "user", "content": "what is two plus three"}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
with torch.no_grad():
    a, b = adapted(ids).logits, merged(ids).logits
print(f"peft adapter vs merged weights: largest logit difference {float((a - b).abs().max()):.2e}")
out = merged.generate(ids, max_new_tokens=4, do_sample=False)
answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
print("what is two plus three ->", answer.strip())
before, after = ([json.loads(line) for line in open(f"{work}/{name}.jsonl")] for name in ("before", "after"))
assert after[0]["completion"] == answer, (after[0], answer)  # the pipeline's greedy answer is transformers'
for b, a in zip(before, after):
    print(f"{b['prompt']!r}: before {b['completion'].strip()!r} -> after {a['completion'].strip()!r}")
EOF
