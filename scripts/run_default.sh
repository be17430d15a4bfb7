#!/usr/bin/env bash
# The README's "run the main job": install what is missing, then train the embedded default — the tiny Qwen3 model
# on the scratchpad-addition task (data.task: addition; each seed its own SFT warm start), end-to-end FP8 recipe
# (configs/tiny_fp8_e2e.yaml, 15 steps, DAPO dynamic sampling), local Ray on 127.0.0.1,
# MLflow in a sqlite file, checkpoints on the local file system — and print where to look.
#   scripts/run_default.sh [key=value ...]     e.g. grpo.max_num_steps=5   (overrides of the recipe)
# Everything (caches, Ray, Prefect, MLflow, checkpoints) stays under runs/; nothing is downloaded after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${RECIPE:-configs/tiny_fp8_e2e.yaml}
T0=$SECONDS
stamp() { printf '[%4ds] %s\n' "$((SECONDS - T0))" "$*"; }

PY=.venv/bin/python
if [ -x "$PY" ] && "$PY" - <<'PY' 2>/dev/null
import importlib.util, sys
mods = ("torch", "vllm", "transformers", "prefect", "ray", "mlflow", "s3fs", "datasets", "fp8core", "flows")
sys.exit(0 if all(importlib.util.find_spec(m) for m in mods) else 1)
PY
then
  stamp "1/3 install: .venv already has everything (scripts/install.sh to re-check)"
else
  stamp "1/3 install (only what is missing): scripts/install.sh"
  bash scripts/install.sh
fi
export PREFECT_HOME="${PREFECT_HOME:-$PWD/runs/.prefect}"
export PREFECT_SERVER_MEMO_STORE_PATH="${PREFECT_SERVER_MEMO_STORE_PATH:-$PREFECT_HOME/memo_store.toml}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true
mkdir -p "$PREFECT_HOME"  # Prefect creates its home without parents: on a fresh clone (no runs/) it warned at import

# Validate the recipe + overrides first (a typo fails here, naming its dotted key) and learn the run dir.
RUN_DIR=$("$PY" - "$RECIPE" "$@" <<'PY'
import sys
from configs.schema import ConfigError, load_config
try:
    cfg = load_config(sys.argv[1], sys.argv[2:])
except ConfigError as e:
    sys.exit(f"config error: {e}")
print(cfg.run_dir)
PY
)

stamp "2/3 embedded assets (tiny model + tokenizer + data + SFT warm start; built once, cached under runs/assets)"
"$PY" - "$RECIPE" "$@" <<'PY'
import sys
from configs.schema import EMBEDDED, load_config
from flows.bootstrap import ensure_assets
cfg = load_config(sys.argv[1], sys.argv[2:])
if EMBEDDED in (cfg.policy.model_name, cfg.data.train_path, cfg.data.validation_path):
    out = ensure_assets.fn(cfg.bootstrap.assets_dir, cfg.bootstrap.sft_steps, cfg.grpo.seed,
                           cfg.data.task)  # same cache as the flow
    print(f"assets: model {out['model_dir']}, data {out['train']} / {out['validation']}")
PY

stamp "3/3 training: $PY -m flows.grpo $RECIPE $*"
"$PY" -m flows.grpo "$RECIPE" "$@"

SUMMARY="$RUN_DIR/summary.json"
stamp "done. Where to look:"
"$PY" - "$SUMMARY" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
uri = s.get("mlflow_tracking_uri")
print(f"  summary      {sys.argv[1]}")
print(f"  accuracy     validation {s['val_accuracy_start']} -> {s['val_accuracy_end']} over {s['steps_run']} steps")
if s.get("checkpoint"):
    print(f"  checkpoint   {s['checkpoint']}")
if uri:
    print(f"  MLflow run   {s['mlflow_run_id']} (experiment \"fp8-grpo\" unless logger.mlflow.experiment_name says otherwise)")
    if s.get("mlflow_ui_command"):
        print(f"  MLflow UI    {s['mlflow_ui_command']}")
    if s.get("mlflow_ui_url"):  # opens the model-training view on this run's charts (val/accuracy, throughput, mismatch)
        print(f"  MLflow charts {s['mlflow_ui_url']}")
PY
