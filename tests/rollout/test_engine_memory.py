"""What an engine's FP8 layers hold, summed over every tensor they keep (rollout.vllm_fp8.fp8_layer_memory), after
the load and after a refit, on the tiny dense and MoE engines: on the scaled_mm path (the GPU's, forced here on CPU
tensors) the FP8 codes and their scales only -- no FP32 staging kept after loading, no dequantized copy -- about 1
byte per FP8 parameter; on the CPU op the codes plus their packed copy (2 bytes per weight with BF16 units, 4
without); the emulation adds its FP32 dequantized copy (4 bytes)."""
from pathlib import Path

import pytest
import torch

from configs.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"

pytestmark = pytest.mark.slow  # two vLLM engines

# bytes per FP8 parameter held by a backend's layers; + 0.1 for the scales (1/16384 of a block, 4/K per row)
PER_PARAM = {"scaled_mm": 1, "emulated": 1 + 4}


def _bound(backend: str) -> float:
    from fp8core.cpu import cpu_caps

    return (1 + (2 if cpu_caps().native_bf16 else 4) if backend == "cpu" else PER_PARAM[backend]) + 0.1


@pytest.mark.parametrize("kind,backend", [("dense", "scaled_mm"), ("moe", "scaled_mm"), ("moe", "cpu")])
def test_fp8_layers_hold_codes_and_scales_only_after_load_and_after_refit(kind, backend, tmp_path):
    from safetensors.torch import load_file

    from diagnostics.mismatch import quick_sft_model
    from rollout.engine import RolloutWorker

    model_dir = quick_sft_model(MODELS, moe=True, steps=20) if kind == "moe" else quick_sft_model(MODELS)
    recipe = "tiny_moe_fp8_e2e.yaml" if kind == "moe" else "tiny_fp8_e2e.yaml"
    cfg = load_config(ROOT / "configs" / recipe, [
        f"policy.megatron_cfg.fp8_cfg.backend={backend}", "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216",
        "policy.generation.vllm_cfg.max_model_len=256", f"run_dir={tmp_path}"])
    engine = RolloutWorker(model_dir, cfg, run_dir=tmp_path / "rollout")
    try:
        loaded = engine.fp8_memory()
        gen = torch.Generator().manual_seed(0)
        masters = {k: v.float() + 0.01 * torch.randn(v.shape, generator=gen)
                   for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        engine.refit(masters)
        refitted = engine.fp8_memory()
    finally:
        engine.shutdown()
    for when, held in (("after load", loaded), ("after refit", refitted)):
        per_param = held["bytes"] / held["fp8_params"]
        print(f"[{kind} engine, {backend}, {when}: {held['layers']} FP8 layers, {held['fp8_params']} FP8 parameters, "
              f"{held['bytes']} bytes = {per_param:.3f} per parameter]")
        assert held["backends"] == [backend] and held["layers"] > 0
        assert per_param <= _bound(backend), (when, per_param)
    assert refitted == loaded
