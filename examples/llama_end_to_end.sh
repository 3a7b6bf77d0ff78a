#!/usr/bin/env bash
# A Llama from text to from_pretrained, offline on the CPU in about a minute (needs pipeflow[hf]):
#
#   1. train a byte-level BPE tokenizer of 512 tokens on a text the repo ships and cut the text into
#      token shards                          (python -m pipeflow.data.prepare --train-tokenizer 512)
#   2. train the tiny random Llama of configs/hf/llama_tiny (transformers' LlamaForCausalLM, 4
#      decoder layers, vocabulary 512) on them, split over 2 pipeline ranks (model=hf data=tokens)
#   3. export the checkpoint under the model's own names  (python -m pipeflow.checkpoint export --format hf)
#   4. load it with AutoModelForCausalLM.from_pretrained, with the tokenizer, and generate a few tokens
#
#   examples/llama_end_to_end.sh                                  # writes under outputs/llama_end_to_end_<time>
#   WORK=/tmp/e2e STEPS=50 examples/llama_end_to_end.sh schedule=zb_h1   # more train.py overrides follow
#
# Settings (environment): WORK (the folder to write; default a new one under outputs/), STEPS
# (training steps, default 300), PROMPT (default "Alice was"), NEW_TOKENS (default 24), PYTHON.
# The text is the opening of chapter I of Lewis Carroll's "Alice's Adventures in Wonderland"
# (1865, public domain): examples/data/alice_chapter1.txt. Point MODEL at a folder of your own
# (config.json [+ *.safetensors] of a Llama, Mistral or Qwen2) and CORPUS at your files to run the
# same steps on them (the token ids must stay below the model's vocab_size: it is checked at start).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
WORK=${WORK:-outputs/llama_end_to_end_$(date +%Y-%m-%d_%H-%M-%S)}
STEPS=${STEPS:-300}
MODEL=${MODEL:-configs/hf/llama_tiny}
CORPUS=${CORPUS:-examples/data/alice_chapter1.txt}
PROMPT=${PROMPT:-Alice was}
NEW_TOKENS=${NEW_TOKENS:-24}

echo "== 1. tokenizer and token shards -> $WORK/tokens"
"$PYTHON" -m pipeflow.data.prepare $CORPUS --train-tokenizer 512 --out "$WORK/tokens" --no-progress

echo "== 2. train: model=hf (2 pipeline ranks, 1F1B) on data=tokens, $STEPS steps"
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 train.py \
    model=hf model.path="$MODEL" data=tokens data.path="$WORK/tokens" data.eos_id=0 data.pack_documents=true \
    data.seq_len=64 data.batch_size=16 data.val_fraction=0.1 parallel.pp=2 pipeline.num_microbatches=4 \
    optim.warmup_steps=10 train.max_steps="$STEPS" train.log_every=50 train.eval_every=100 \
    train.save_every="$STEPS" train.run_dir="$WORK/run" "$@"

echo "== 3. export --format hf -> $WORK/hf"
"$PYTHON" -m pipeflow.checkpoint export --format hf "$WORK/run/checkpoints" "$WORK/hf"

echo "== 4. from_pretrained and generate"
"$PYTHON" - "$WORK" "$PROMPT" "$NEW_TOKENS" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging

logging.disable_progress_bar()

work, prompt, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
# the tokenizer that prepare trained, saved beside the weights: the folder is a whole HF model
PreTrainedTokenizerFast(tokenizer_file=f"{work}/tokens/tokenizer.json",
                        eos_token="<|endoftext|>").save_pretrained(f"{work}/hf")
tokenizer = AutoTokenizer.from_pretrained(f"{work}/hf")
model = AutoModelForCausalLM.from_pretrained(f"{work}/hf").eval()
print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters) "
      f"and a tokenizer of {len(tokenizer)} tokens from {work}/hf")
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
print(f"prompt: {prompt!r}")
print(f"greedy: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")
EOF
