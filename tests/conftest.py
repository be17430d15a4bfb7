"""Test-wide environment: every cache and temp dir under runs/test-env (never $HOME), nothing reaches out."""
import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1] / "runs" / "test-env"
_ENV = {
    "HF_HOME": _ROOT / "hf",
    "VLLM_CACHE_ROOT": _ROOT / "vllm-cache",
    "TORCHINDUCTOR_CACHE_DIR": _ROOT / "inductor",
    "PREFECT_HOME": _ROOT / "prefect",
    "PREFECT_SERVER_MEMO_STORE_PATH": _ROOT / "prefect" / "memo_store.toml",
    "RAY_TMPDIR": Path("/tmp") / f"ray-fp8grpo-{os.getuid()}",
}
for key, path in _ENV.items():
    os.environ.setdefault(key, str(path))
    (path.parent if key.endswith("_PATH") else path).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DO_NOT_TRACK", "1")
