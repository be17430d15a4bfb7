"""The trainer's replay of the rollout engine's FP8 KV cache: attention whose post-RoPE key and value go through
E4M3 with the engine's per-layer scales (``fp8core.rl.kv_calibration.round_through_e4m3``, the function the engine's
emulated cache uses), installed as a transformers attention implementation for the duration of a ``with`` block.

Used by the policy worker when ``calibration.kv_rounding_in_trainer`` is on (its old-logprob and training forwards
see the K/V the engine saw; the gradient passes straight through the rounding) and by ``diagnostics.kv_attribution``
(scoring only, with a saturation count).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from fp8core.quant import E4M3_MAX
from fp8core.rl.kv_calibration import round_through_e4m3


class _Saturation:
    """Counts K / V elements of real tokens (attention mask 1) beyond ``E4M3_MAX * scale``."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [B, T] of the current forward
        self.over = {"k": 0, "v": 0}
        self.total = {"k": 0, "v": 0}

    def add(self, name: str, x: torch.Tensor, scale: float) -> None:  # x: [B, H, T, D]
        over = (x.float().abs() > E4M3_MAX * scale).any(dim=1)  # [B, T, D]
        keep = self.mask.bool() if self.mask is not None and self.mask.shape == over.shape[:2] else None
        sel = over[keep] if keep is not None else over.reshape(-1, over.shape[-1])
        self.over[name] += int(sel.sum())
        self.total[name] += int(sel.numel())

    def fractions(self) -> dict[str, float]:
        return {n: self.over[n] / self.total[n] if self.total[n] else 0.0 for n in ("k", "v")}


@contextlib.contextmanager
def kv_rounding(model, scales: Mapping[str, list[float]], *, round_k: bool, round_v: bool,
                saturation: _Saturation | None = None):
    """Within the block, ``model``'s attention rounds the post-RoPE key (``round_k``) and the value (``round_v``)
    through E4M3 with layer ``layer_idx``'s ``k_scale`` / ``v_scale``, as the engine's FP8 KV cache does, then runs
    the model's own attention implementation (SDPA, eager, ...) with that implementation's masks. The previous
    implementation is restored on exit. ``scales`` is read at every forward, so it may be updated in place."""
    import sys

    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = model.config._attn_implementation or "eager"
    if previous not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"kv_rounding: attention implementation {previous!r} has no mask function to reuse")
    inner_cache: dict[type, object] = {}

    def inner(module):
        fn = inner_cache.get(type(module))
        if fn is None:
            if previous == "eager":  # each HF model file defines its own eager attention
                fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            else:
                fn = ALL_ATTENTION_FUNCTIONS[previous]
            if fn is None:
                raise ValueError(f"kv_rounding: no eager_attention_forward in {type(module).__module__}")
            inner_cache[type(module)] = fn
        return fn

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = int(module.layer_idx)
        ks, vs = float(scales["k_scale"][layer]), float(scales["v_scale"][layer])
        if saturation is not None:
            saturation.add("k", key, ks)
            saturation.add("v", value, vs)
        if round_k:
            key = round_through_e4m3(key, ks)
        if round_v:
            value = round_through_e4m3(value, vs)
        return inner(module)(module, query, key, value, attention_mask, **kwargs)

    name = f"fp8grpo_kv_round_{int(round_k)}{int(round_v)}_{previous}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])  # the masks it would get
    hook = None
    if saturation is not None:
        def keep_mask(_module, _args, kwargs):
            saturation.mask = kwargs.get("attention_mask")

        hook = model.register_forward_pre_hook(keep_mask, with_kwargs=True)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        if hook is not None:
            hook.remove()


def unit_scales(num_layers: int) -> dict[str, list[float]]:
    """The scales an engine uses before any were set (vLLM's default 1.0 per layer)."""
    return {f"{k}_scale": [1.0] * num_layers for k in "qkv"}
