"""Process environment for the command-line entry points (``python -m flows.grpo``, ``python -m experiments.learning``),
set before Prefect is imported: Prefect reads its home and logging settings at import. Imports nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path


def prefect_cli_env() -> None:
    """Keep Prefect's state under runs/.prefect and its console logging quiet, so the terminal shows our one line
    per step (values already in the environment win)."""
    home = Path("runs/.prefect").resolve()
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(home / "memo_store.toml"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    home.mkdir(parents=True, exist_ok=True)
