#!/usr/bin/env bash
# The prepared GPU check for a lent machine, unattended: one markdown report, every step's exit status.
#
#   OUT=/tmp/gpu_out bash benchmarks/gpu_check.sh        # on the GPU machine (about 8 min on one GPU)
#   OUT=/tmp/dry bash benchmarks/gpu_check.sh            # here, without CUDA: a dry run, exit 2
#
# The GPU machine has its own torch (2.11) but no hydra-core, omegaconf or antlr4 and no network:
# their pure-Python wheels travel in benchmarks/wheels/ (ignored by git; fetch them with
#   pip download hydra-core==1.3.8 omegaconf==2.3.1 --no-deps -d benchmarks/wheels
#   pip wheel antlr4-python3-runtime==4.9.3 --no-deps -w benchmarks/wheels
# and carry the folder) and are installed into $SITE without an index when python3 lacks them
# (PIPEFLOW_FORCE_WHEELS=1 installs them anyway, to prove they suffice).  single_gpu.py and the
# benchmarks need none of them.
#
# One GPU: single_gpu.py (stage compute, bf16, freed outputs, peak memory, stream waits, a batched
# send to self on a one-rank NCCL group while the compute stream is busy, CUDA-event timing), the
# cluster planner's roofline terms against this GPU (roofline_probe.py: bf16 matmuls at widths
# 768-8192, an elementwise pass, SDPA forward and backward; under a minute), then
# a one-rank `python train.py` on CUDA with bf16 and a traced step (CUDA-event figures checked by
# run_figures.py), and one with fp16, a forced gradient overflow and train.check_finite=true
# (the step is skipped, the run goes on), then pipeflow on one rank against the plain PyTorch loop
# over the same layers (vs_plain_loop.py: step ratio, steady-step allocator peak ratio, start-of-run
# prediction beside the measured step; about 3 min; its lines also go to $OUT/RESULTS.md), activation
# offload (offload.py: pipeline.offload=none, auto and all on a GPipe GPT 12x1024, seq 1024, m = 8,
# bf16: the host link measured, step, allocator and tensor peaks and bytes offloaded beside the
# prediction; about 1.5 min; its lines also go to $OUT/RESULTS.md), and with
# train.compile (--compile: eager vs compiled, the compiled plain loop, compiled zb_h1 against 1f1b
# and against zb_h1 repeating the compiled backward; a few minutes of compiling).  Two or
# more GPUs: also the NCCL equivalence, a 2-rank traced train.py and the side-by-side with
# torch.distributed.pipelining (4 GPUs: more of each).
# $OUT/gpu_check.md is the report (each step: exit status, seconds, the end of its output) and
# $OUT/RESULTS.md the benchmark tables, for benchmarks/RESULTS.md.  Full logs stay in $LOGS.
# Exit: 0 all passed, 1 a step failed, 2 no CUDA device (nothing on a GPU was checked).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/pipeflow_gpu_check}
LOGS=${LOGS:-/tmp/pipeflow_gpu_logs}
SITE=${SITE:-/tmp/pipeflow_site}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$LOGS"
report="$OUT/gpu_check.md"
summary=()
status=0

step() {  # step <seconds> <log name> <description> <command...>: run it, keep its exit status, report it
  local limit=$1 log="$LOGS/$2.log" what=$3
  shift 3
  local rc start took
  start=$(date +%s%N)
  timeout "$limit" "$@" > "$log" 2>&1
  rc=$?  # the command's status, read before anything else runs
  took=$(( ($(date +%s%N) - start) / 1000000 ))
  {
    echo "### $what"
    echo
    echo "exit status $rc after $((took / 1000)).$(printf '%03d' $((took % 1000))) s: \`$*\`"
    echo
    echo '```'
    tail -n 30 "$log"
    echo '```'
    echo
  } >> "$report"
  summary+=("| $what | $rc | $((took / 1000)).$(printf '%03d' $((took % 1000))) |")
  if [ "$rc" -eq 0 ]; then
    echo "ok: $what"
  else
    echo "FAILED (exit status $rc): $what"
    status=1
  fi
  return "$rc"
}

finish() {  # finish <exit status>: the summary table, then exit
  {
    echo "### Summary"
    echo
    echo "| step | exit status | seconds |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${summary[@]}"
    echo
    echo "overall exit status: $1"
  } >> "$report"
  echo "report: $report"
  exit "$1"
}

{
  echo "## GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  gpu_line=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  echo "    ${gpu_line:-nvidia-smi lists no GPU}"
  echo "    $($PY -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)')"
  echo
} > "$report"

# hydra-core, omegaconf, antlr4 for train.py: from the carried wheels, without a network
if [ "${PIPEFLOW_FORCE_WHEELS:-0}" = 1 ] || ! $PY -c "import hydra, omegaconf" 2>/dev/null; then
  step 120 wheels "install the carried wheels (hydra-core, omegaconf, antlr4) into $SITE" \
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    benchmarks/wheels/*.whl || finish 1
  export PYTHONPATH="$SITE"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
step 120 imports "train.py's imports with this torch" $PY -c "
import hydra, omegaconf, torch
import pipeflow.run.builder, pipeflow.commands.sweep
print('hydra', hydra.__version__, 'from', hydra.__file__)
print('omegaconf', omegaconf.__version__, '| torch', torch.__version__)" || finish 1

gpus=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
echo "CUDA devices: $gpus" >> "$report"
if [ "$gpus" -lt 1 ]; then
  echo "no CUDA device here: stopping before the GPU checks (a dry run; nothing on a GPU was checked)" | tee -a "$report"
  finish 2
fi

SMALL=(model.n_layer=4 model.n_embd=256 model.n_head=4 data.batch_size=32 data.num_tokens=200000
       train.eval_batches=2 train.log_every=5 metrics.tensorboard=false metrics.progress_bar=false dist.device=cuda)
step 300 gpu_single "single-GPU CUDA paths (gpu_checks/single_gpu.py)" $PY benchmarks/gpu_checks/single_gpu.py
step 120 roofline "the planner's roofline terms measured: matmul widths, a memory pass, SDPA (gpu_checks/roofline_probe.py)" \
  $PY benchmarks/gpu_checks/roofline_probe.py --out "$OUT/RESULTS.md"
step 240 train_bf16 "train.py on one GPU: bf16, a traced step" $PY train.py "${SMALL[@]}" train.precision=bf16 \
  train.max_steps=30 "metrics.trace_steps=[10]" train.run_dir="$LOGS/run_bf16"
step 60 check_bf16 "bf16 run: CUDA-event figures (compute > 0, bubble in [0, 1))" $PY benchmarks/gpu_checks/run_figures.py \
  "$LOGS/run_bf16" "$LOGS/train_bf16.log"
step 240 train_fp16 "train.py on one GPU: fp16, a forced overflow, check_finite" \
  env PIPEFLOW_FAULT_INJECT=overflow:rank=0:step=4 $PY train.py "${SMALL[@]}" train.precision=fp16 train.check_finite=true train.max_steps=20 \
  "metrics.trace_steps=[8]" train.run_dir="$LOGS/run_fp16"
step 60 check_fp16 "fp16 run: the overflow skipped, figures sane" $PY benchmarks/gpu_checks/run_figures.py "$LOGS/run_fp16" \
  "$LOGS/train_fp16.log" \
  --expect "step 4: inf/nan gradients (fp16 overflow); step skipped"
step 420 vs_plain "pipeflow vs the plain PyTorch loop on one GPU (GPT 12x1024, bf16, m = 4 and 16)" \
  $PY benchmarks/overhead/vs_plain_loop.py --device cuda --out "$OUT/RESULTS.md"
step 300 offload "activation offload on one GPU: pipeline.offload none, auto, all (GPT 12x1024, seq 1024, gpipe, m = 8, bf16)" \
  $PY benchmarks/features/offload.py --device cuda --out "$OUT/RESULTS.md"
step 540 vs_plain_compile "train.compile on one GPU: eager vs compiled, compiled plain loop, zb_h1 vs 1f1b (m = 8)" \
  $PY benchmarks/overhead/vs_plain_loop.py --device cuda --compile --repeat-backward --case m=8 --rounds 2 --out "$OUT/RESULTS.md"
if [ "$gpus" -ge 2 ]; then
  step 150 nccl_eq_2 "NCCL equivalence, 2 GPUs" $PY -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_checks/nccl_equivalence.py
  step 240 train_2gpu "train.py on 2 GPUs: bf16, a traced step" $PY -m torch.distributed.run --nproc-per-node 2 train.py \
    "${SMALL[@]}" train.precision=bf16 train.max_steps=30 "metrics.trace_steps=[10]" train.run_dir="$LOGS/run_2gpu"
  step 60 check_2gpu "2-GPU run: CUDA-event figures" $PY benchmarks/gpu_checks/run_figures.py "$LOGS/run_2gpu" \
    "$LOGS/train_2gpu.log"
  step 200 vs_torch_2 "vs torch.distributed.pipelining, MLP, 2 GPUs" $PY -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/overhead/vs_torch_pipelining.py --device cuda --hidden 512 64 --schedules gpipe 1f1b --rounds 20 --out "$OUT/RESULTS.md"
fi
if [ "$gpus" -ge 4 ]; then
  step 150 nccl_eq_4 "NCCL equivalence, 4 GPUs" $PY -m torch.distributed.run --nproc-per-node 4 benchmarks/gpu_checks/nccl_equivalence.py
  step 200 vs_torch_4 "vs torch.distributed.pipelining, GPT blocks, 4 GPUs" $PY -m torch.distributed.run --nproc-per-node 4 \
    benchmarks/overhead/vs_torch_pipelining.py --device cuda --model gpt --hidden 256 --schedules gpipe 1f1b interleaved_1f1b zbv \
    --rounds 10 --out "$OUT/RESULTS.md"
fi
if [ "$gpus" -lt 2 ]; then
  echo "one GPU: NCCL between ranks needs two, so the equivalence and the side-by-side did not run" | tee -a "$report"
fi
finish "$status"
