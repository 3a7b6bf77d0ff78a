#!/usr/bin/env bash
# A DeepSeek-V3-shaped mixture of experts fine-tuned with LoRA on pp 2 x ep 2 with DualPipeV, offline
# on the CPU in about a minute (needs pipeflow[hf]):
#
#   1. make a tiny random DeepSeek-V3 folder with transformers (8 routed experts, top 2, one shared
#      expert, group-limited routing, the first layer dense), saved as the hub stores it: each
#      expert's tensors apart (experts.3.gate_proj ...)
#   2. fine-tune LoRA adapters on its latent attention on 4 processes: 2 pipeline stages x 2
#      data-parallel ranks over which each MoE layer's experts are split (parallel.ep=2), DualPipeV
#      overlapping each micro-batch pair's all_to_all with the other's compute; the experts, loaded
#      into fused weights through transformers' conversion mapping, stay frozen
#   3. generate on the pipeline from the run's checkpoint (python -m pipeflow.generate: 2 stages, the
#      adapters applied, the experts whole on each rank: a checkpoint loads under any ep), with a
#      word-level tokenizer of the tiny model's 64 ids (t0 ... t63) saved beside it
#   4. export the adapters merged into the model (python -m pipeflow.checkpoint export --format hf
#      --merge-lora), each expert's tensors apart as the hub stores them, and generate with
#      transformers: the same tokens
#
#   examples/moe_finetune.sh                                   # writes under outputs/moe_finetune_<time>
#   WORK=/tmp/moe STEPS=40 examples/moe_finetune.sh train.log_every=5   # more train.py overrides follow
#
# Settings (environment): WORK (default a new folder under outputs/), STEPS (default 20), MODEL (a
# folder of your own: config.json + *.safetensors of any family docs/reference/hf-families.md lists
# with experts; set TARGETS to its attention's Linear names), TARGETS (default
# [q_b_proj,kv_b_proj,o_proj]), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
WORK=${WORK:-outputs/moe_finetune_$(date +%Y-%m-%d_%H-%M-%S)}
STEPS=${STEPS:-20}
TARGETS=${TARGETS:-[q_b_proj,kv_b_proj,o_proj]}
mkdir -p "$WORK"

if [ -z "${MODEL:-}" ]; then
    MODEL=$WORK/tiny-deepseek-v3
    echo "== 1. a tiny random DeepSeek-V3 -> $MODEL"
    "$PYTHON" - "$MODEL" <<'EOF'
import sys

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                          num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                          topk_group=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                          v_head_dim=8, max_position_embeddings=64)
torch.manual_seed(0)
DeepseekV3ForCausalLM(config).save_pretrained(sys.argv[1])
EOF
fi
if [ ! -f "$MODEL/tokenizer.json" ]; then
    "$PYTHON" - "$MODEL" <<'EOF'
import json
import sys

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

size = json.load(open(f"{sys.argv[1]}/config.json"))["vocab_size"]
words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(sys.argv[1])  # no special tokens: every id shows
EOF
fi

echo "== 2. LoRA on pp 2 x dp 2 (ep 2) with DualPipeV -> $WORK/run"
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 4 train.py model=hf "model.path=$MODEL" \
    parallel.pp=2 parallel.dp=2 parallel.ep=2 schedule=dualpipev pipeline.num_microbatches=4 \
    model.lora.rank=8 "model.lora.targets=$TARGETS" data=markov data.vocab_size=64 data.seq_len=16 \
    data.batch_size=16 train.max_steps="$STEPS" train.save_every="$STEPS" train.eval_every=0 train.log_every=5 \
    metrics.tensorboard=false "train.run_dir=$WORK/run" "$@"

echo "== 3. generate on the pipeline (2 stages) from the run's checkpoint"
printf 't5 t6 t7 t8\n' > "$WORK/prompts.txt"
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeflow.generate \
    "train.resume=$WORK/run/checkpoints" "generate.prompts=$WORK/prompts.txt" generate.max_new_tokens=8 \
    "generate.output=$WORK/generated.jsonl" parallel.dp=1 parallel.ep=1
cat "$WORK/generated.jsonl"

echo "== 4. export merged, generate with transformers -> $WORK/merged"
"$PYTHON" -m pipeflow.checkpoint export --format hf --merge-lora "$WORK/run/checkpoints" "$WORK/merged"
"$PYTHON" - "$WORK/merged" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
prompt = torch.tensor([[5, 6, 7, 8]])
out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8, pad_token_id=0)
print("generated:", out[0, prompt.shape[1]:].tolist())
EOF
