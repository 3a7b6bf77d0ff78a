#!/usr/bin/env bash
# One prepared GPU check for a lent machine; runs in under 8 minutes and writes to $OUT.
#
#   OUT=/tmp/gpu_out bash benchmarks/gpu_check.sh
#
# One GPU (NCCL will not put two ranks on one GPU): the CUDA paths one GPU can exercise
# (benchmarks/gpu_single.py: stage compute and activations on CUDA, bf16, freed outputs,
# peak-memory accounting, comm waits as stream waits).  Two or more GPUs: also the pipelined
# equivalence on NCCL (float32, TF32 off) for every schedule and the side-by-side benchmark
# against torch.distributed.pipelining on 2 (and 4) GPUs.  $OUT/gpu_check.md says what ran;
# $OUT/RESULTS.md holds the benchmark tables, to be appended to benchmarks/RESULTS.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pipeflow_gpu_check}
mkdir -p "$OUT"
log="$OUT/gpu_check.md"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  echo "## GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/    /'
  echo "    torch $(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)'), $gpus GPU(s)"
  echo
} > "$log"
status=0
run() {  # run <seconds> <description> <command...>: log the outcome, keep going on failure
  local limit=$1 what=$2
  shift 2
  echo "### $what" >> "$log"
  echo '```' >> "$log"
  if timeout "$limit" "$@" >> "$log" 2> "$OUT/stderr_$(echo "$what" | tr -c 'a-z0-9' '_').txt"; then
    echo '```' >> "$log"; echo "ok: $what" | tee -a "$log"
  else
    echo '```' >> "$log"; echo "FAILED ($?): $what" | tee -a "$log"; status=1
  fi
}
run 120 "single-GPU CUDA paths" python3 benchmarks/gpu_single.py
if [ "$gpus" -ge 2 ]; then
  run 90 "NCCL equivalence, 2 GPUs" torchrun --nproc-per-node 2 benchmarks/nccl_equivalence.py
  run 100 "vs torch.distributed.pipelining, MLP, 2 GPUs" torchrun --nproc-per-node 2 \
    benchmarks/vs_torch_pipelining.py --device cuda --hidden 512 64 --schedules gpipe 1f1b --rounds 20 --out "$OUT/RESULTS.md"
fi
if [ "$gpus" -ge 4 ]; then
  run 90 "NCCL equivalence, 4 GPUs" torchrun --nproc-per-node 4 benchmarks/nccl_equivalence.py
  run 100 "vs torch.distributed.pipelining, GPT blocks, 4 GPUs" torchrun --nproc-per-node 4 \
    benchmarks/vs_torch_pipelining.py --device cuda --model gpt --hidden 256 --schedules gpipe 1f1b interleaved_1f1b zbv --rounds 10 --out "$OUT/RESULTS.md"
fi
if [ "$gpus" -lt 2 ]; then
  echo "one GPU: NCCL between ranks needs two GPUs, so only the single-GPU checks ran" | tee -a "$log"
fi
exit $status
