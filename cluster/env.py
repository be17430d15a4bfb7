"""The run's process environment: caches under the run dir and the offline / quiet switches, set before Ray and
vLLM start so every process of the run inherits them (existing values win)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_env(run_dir: Path) -> dict[str, str]:
    """Caches and switches for every process of the run (set before Ray starts, so actors inherit them)."""
    cache = run_dir / "cache"
    env = {
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "HF_HOME": str(cache / "hf"),
        "PREFECT_HOME": str(cache / "prefect"),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(cache / "prefect" / "memo_store.toml"),
    }
    fixed = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
             "VLLM_NO_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
             "VLLM_LOGGING_LEVEL": "ERROR", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return {**env, **fixed}


def apply_env(run_dir: Path) -> None:
    """Set the run's environment (existing values win, so tests and users can point caches elsewhere)."""
    for key, value in cache_env(run_dir).items():
        os.environ.setdefault(key, value)
        if key.endswith(("_ROOT", "_DIR", "_HOME")):
            Path(os.environ[key]).mkdir(parents=True, exist_ok=True)
