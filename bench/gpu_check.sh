#!/usr/bin/env bash
# GPU readiness check (bench/gpu_check.py): the trainer's FP8 GEMMs and quantizer on the device against the CPU
# reference, which GEMM path ran, FP8 / BF16 linear speed, quantize GB/s, one FP8 training step of the tiny model.
# Needs only python + a CUDA torch + transformers (no vLLM / Ray / Prefect); expected 2-4 min on one H100 / H200 (not
# run on a GPU yet), killed at 5.
# Writes runs/bench/gpu_check.json (or $1). Exit 1 if a check fails, 2 if no python here has a CUDA torch.
# The python: $PYTHON, else the first of python3 / .venv/bin/python whose torch sees a CUDA device (the project's
# .venv holds the CPU torch on CPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/bench/gpu_check.json}"
PROBE='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
PY=""
for cand in ${PYTHON:-} python3 .venv/bin/python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "$PROBE" 2>/dev/null; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
  for cand in ${PYTHON:-} python3 .venv/bin/python; do
    command -v "$cand" >/dev/null 2>&1 || continue
    line=$("$cand" -c 'import torch; print("torch", torch.__version__ + ", CUDA", torch.version.cuda or "none (a CPU-only build)")' 2>&1 | tail -1 || true)
    echo "gpu_check: $cand: $line: no CUDA device visible" >&2
  done
  echo "gpu_check: no python here has a torch that sees a CUDA device (set PYTHON=...)" >&2
  exit 2
fi
# the CPU reference runs fp8core's torch quantizer (bit-identical to its C++ kernel): no kernel build on this machine
export FP8GRPO_QDQ_KERNEL="${FP8GRPO_QDQ_KERNEL:-torch}"
exec timeout 300 "$PY" bench/gpu_check.py --device cuda --out "$OUT"
