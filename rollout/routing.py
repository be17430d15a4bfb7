"""MoE routing capture inside the rollout engine (``RolloutWorker.routed_experts``, for routing replay): our MoE
methods (rollout/vllm_fp8.py ``Fp8CoreMoEMethod``, rollout/vllm_bf16.py ``Bf16EmulatedMoEMethod``) keep the last
forward's ``topk_ids`` per layer while ``record_routing`` is on.
"""
from __future__ import annotations

import torch

from rollout.kv_cache import _layer_index


# Functions run on the model inside the engine (llm.apply_model); module-level so they pickle on multi-process GPU
# setups too.
def _moe_methods(model) -> list:
    """Our MoE methods (FP8 or BF16-emulated experts), in decoder-layer order."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    found = [(name, m.quant_method) for name, m in model.named_modules()
             if isinstance(m, RoutedExperts) and hasattr(m.quant_method, "record_routing")]
    return [qm for _, qm in sorted(found, key=lambda t: _layer_index(t[0]))]


def _set_moe_recording(model, on: bool) -> int:
    for qm in _moe_methods(model):
        qm.record_routing, qm.last_topk_ids = on, None
    return 0


def _moe_recorded_ids(model) -> list[torch.Tensor]:
    return [qm.last_topk_ids for qm in _moe_methods(model) if qm.last_topk_ids is not None]
