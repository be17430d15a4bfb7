"""The run's process environment: caches under the run dir and the offline / quiet switches, set before Ray and
vLLM start so every process of the run inherits them (existing values win).

Hugging Face models and datasets named by hub id come from the user's own Hugging Face cache (HF_HOME /
HF_HUB_CACHE are left alone: storage/hub.py); only ``datasets``' processing cache (HF_DATASETS_CACHE) is kept
under the run dir, so a run writes nothing to $HOME. Offline (HF_HUB_OFFLINE=1) unless the recipe says
``hub.allow_downloads: true``."""

from __future__ import annotations

import os
from pathlib import Path

# the switches that keep huggingface_hub / transformers from the network: both must be off to download
OFFLINE_KEYS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def cache_env(run_dir: Path) -> dict[str, str]:
    """Caches and switches for every process of the run (set before Ray starts, so actors inherit them).

    The compile caches (vLLM's, TorchInductor's) hold results keyed by what produced them, so the runs of one runs
    folder share them under ``<run_dir>/../.cache``: a run's first engine otherwise repeats vLLM's model-class
    inspection, a subprocess of ~12 s of CPU. Prefect's home (its temporary server's database) and the datasets
    processing cache stay per run (concurrent runs must not share a sqlite database)."""
    cache, shared = run_dir / "cache", run_dir.parent / ".cache"
    env = {
        "VLLM_CACHE_ROOT": str(shared / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(shared / "inductor"),
        "HF_DATASETS_CACHE": str(cache / "datasets"),
        "PREFECT_HOME": str(cache / "prefect"),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(cache / "prefect" / "memo_store.toml"),
    }
    fixed = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
             "VLLM_NO_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
             "VLLM_LOGGING_LEVEL": "ERROR", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             # Prefect waits 20 s for a run's temporary server to answer; a busy 2-core machine can take longer,
             # and the run then died before its first task
             "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
             # a local Ray prestarts idle Python workers for plain tasks when the driver connects (two more on 2
             # CPUs, ~1.5 s CPU each); the run's actors carry their own runtime_env and never use them
             "RAY_prestart_worker_first_driver": "0"}
    return {**env, **fixed}


def apply_env(run_dir: Path, *, allow_downloads: bool = False) -> None:
    """Set the run's environment (existing values win, so tests and users can point caches elsewhere), except that
    ``allow_downloads`` (the recipe's ``hub.allow_downloads``) turns the offline switches off for the run."""
    for key, value in cache_env(run_dir).items():
        os.environ.setdefault(key, value)
        if key.endswith(("_ROOT", "_DIR", "_HOME")):
            Path(os.environ[key]).mkdir(parents=True, exist_ok=True)
    if allow_downloads:
        os.environ.update(dict.fromkeys(OFFLINE_KEYS, "0"))
