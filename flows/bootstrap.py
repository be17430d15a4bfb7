"""Flow ``bootstrap-tiny``: the embedded default's assets (synthetic task splits + tiny Qwen3 + SFT warm start), built
once and cached under ``assets_dir`` (embedded/bootstrap.py does the work; a second call returns at once). ``task``
is ``data.task``: ``addition`` (default) or ``arithmetic``; ``model`` is ``bootstrap.model``: ``dense`` (default) or
``moe`` (the tiny Qwen3-MoE); ``size`` holds the ``bootstrap`` size keys that are set (``BootstrapCfg.model_size()``;
none = the built-in size)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

import process.quiet  # noqa: F401  third-party start-up noise off before transformers loads (process/quiet.py)


@task(name="ensure-default-assets", cache_policy=NO_CACHE)
def ensure_assets(assets_dir: str, sft_steps: int | None, seed: int, data_task: str,
                  model: str = "dense", size: dict[str, int] | None = None) -> dict[str, str]:
    from embedded.bootstrap import default_sft, ensure_default_assets, model_spec

    sft = default_sft(data_task, seed=seed, steps=sft_steps)
    out = ensure_default_assets(Path(assets_dir), task=data_task, sft=sft, model=model, spec=model_spec(model, size))
    return {k: str(v) for k, v in out.items()}


@flow(name="bootstrap-tiny", log_prints=True)
def bootstrap_flow(assets_dir: str = "runs/assets", sft_steps: int | None = None, seed: int = 0,
                   data_task: str = "addition", model: str = "dense",
                   size: dict[str, int] | None = None) -> dict[str, str]:
    return ensure_assets(assets_dir, sft_steps, seed, data_task, model, size)


if __name__ == "__main__":
    import sys

    print(bootstrap_flow(*(sys.argv[1:2] or [])))
