#!/usr/bin/env bash
# One command for the performance bench (its ratios: bench/__main__.py): python -m bench in the project venv; the TRL
# peer runs in .venv-bench (TRL + accelerate only, layered over .venv's packages), created here on first use.
#   bash scripts/bench.sh                 # full table: numerics, project steps (BF16 reference, FP8 e2e), TRL step
#   bash scripts/bench.sh --skip-trl      # without the TRL peer
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BENCH=.venv-bench
if [[ " $* " != *" --skip-trl "* && ! -x "$BENCH/bin/python" ]]; then
  echo "bench: creating $BENCH (TRL for the peer step; requirements-bench.txt)"
  "$PY" -m venv --without-pip "$BENCH"
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  bsite=$("$BENCH/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$bsite/_project_venv.pth"   # torch / transformers / datasets from .venv: same versions
  if command -v uv >/dev/null; then
    uv pip install --python "$BENCH/bin/python" -r requirements-bench.txt
  else
    "$PY" -m pip install --target "$bsite" --no-deps -r requirements-bench.txt
  fi
fi
export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/runs/bench/vllm-cache}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/runs/bench/inductor-cache}"
exec "$PY" -m bench --trl-python "$BENCH/bin/python" "$@"
