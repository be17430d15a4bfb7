#!/usr/bin/env bash
# GPU readiness check (bench/gpu_check.py): FP8 scaled_mm vs emulation for every recipe, FP8/BF16 linear speed at
# 4096-8192 dims, quantize GB/s. Needs only python + torch with CUDA (no vLLM / Transformer Engine); ~3-5 min on
# one H200. Writes runs/bench/gpu_check.json (or $1). Exit 1 if a recipe disagrees beyond the stated tolerance.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${1:-runs/bench/gpu_check.json}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
exec timeout 480 "$PY" bench/gpu_check.py --device cuda --out "$OUT"
