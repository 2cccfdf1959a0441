#!/usr/bin/env bash
# One-GPU check (< 8 minutes on one H200): a ~1B-parameter Llama-style model (the "1b" preset,
# 4 x 1024 tokens per step), FSDP2 with bf16 mixed precision, plain vs ours vs per-param AdamW.
# Prints and writes (scaling.md / .json) the peak allocated memory (CUDA allocator) with its
# breakdown by kind, the step time, and how much optimizer time ours hides behind backward
# (summary columns "plain after-backward ms" and "ours saves ms").
#
#   benchmarks/gpu_check.sh [OUT_DIR]                  # CUDA, default OUT_DIR below
#   GPU_CHECK_TINY=1 benchmarks/gpu_check.sh [OUT_DIR] # same run on CPU with a tiny Llama
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-benchmarks/results/gpu_check}
limit_s=480  # the 8-minute budget; exceeding it fails the check (exit status 124)
if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then
  target=(--device cpu --shapes llama-tiny)
else
  python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else
    "no CUDA device: set GPU_CHECK_TINY=1 to run the CPU variant")'
  target=(--device cuda --shapes llama-1b)
fi

timeout "$limit_s" python -m benchmarks.scaling "${target[@]}" --bf16 --world-sizes 1 --scalings strong \
  --methods plain ours per-param --warmup-steps 3 --timed-steps 10 --out "$out"
