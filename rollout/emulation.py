"""What the rollout engine hooks into vLLM so that it computes what the recipe asks on any CPU, installed by
rollout/engine.py (``RolloutWorker``):

- the FP8 KV-cache emulation (``kv_mode == "fp8-emulated"``, rollout/kv_cache.py): a forward pre-hook on every vLLM
  ``Attention`` layer rounds K and V through the E4M3 grid with the layer's scales (``round_kv_through_e4m3``)
  before attention and the (BF16) cache write see them;
- eager sampled-token ranks on CPU (``_eager_token_ranks``): the same integers as vLLM's compiled kernel, without
  compiling it in every engine process.

The BF16-emulated linears and MoE experts are vLLM plugins of their own (rollout/vllm_bf16.py).
"""
from __future__ import annotations

import torch

from rollout.kv_cache import _attention_layers


def round_kv_through_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` rounded through the E4M3 grid with dequantization scale ``scale`` (round to nearest even, saturating at
    +-448 * scale), in ``x``'s dtype: what an FP8 cache with that scale gives back, computed in FP32. The one
    definition the trainer's replay uses too (``fp8core.rl.kv_calibration.round_through_e4m3``)."""
    from fp8core.rl.kv_calibration import round_through_e4m3

    return round_through_e4m3(x, scale)


def _round_kv_pre_hook(module, args, kwargs):
    """Forward pre-hook of a vLLM ``Attention`` layer (``forward(query, key, value, ...)``): K and V go through the
    E4M3 grid with the layer's current float scales (the ones rollout/kv_cache.py ``_set_attention_scales`` writes),
    before attention and the (BF16) cache write see them."""
    k_scale, v_scale = float(module._k_scale_float), float(module._v_scale_float)
    args = list(args)
    for pos, name, scale in ((1, "key", k_scale), (2, "value", v_scale)):
        if len(args) > pos:
            if args[pos] is not None:
                args[pos] = round_kv_through_e4m3(args[pos], scale)
        elif kwargs.get(name) is not None:
            kwargs[name] = round_kv_through_e4m3(kwargs[name], scale)
    return tuple(args), kwargs


def _install_kv_emulation(model) -> int:
    """Hook every attention layer once (idempotent; hooks survive weight reloads). Returns the number hooked."""
    layers = _attention_layers(model)
    for layer in layers.values():
        if getattr(layer, "_fp8grpo_kv_emulation", None) is None:
            layer._fp8grpo_kv_emulation = layer.register_forward_pre_hook(_round_kv_pre_hook, with_kwargs=True)
    return sum(getattr(m, "_fp8grpo_kv_emulation", None) is not None for m in layers.values())


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x``, how many entries are >= that row's value (a sampled token's rank): the expression vLLM's
    sampler compiles, run eagerly."""
    return (x >= values).sum(-1)


def _eager_token_ranks() -> None:
    """On CPU, vLLM's sampler ranks each sampled token with a ``torch.compile``d comparison-and-sum
    (vllm.v1.sample.ops.logprobs.batched_count_greater_than): inductor compiles it at the first sampled logprob of
    every engine process, ~9 s on a 2-core CPU (a compile cache does not remove the tracing), for one comparison and
    one sum. The eager expression gives the same integers; its transient (tokens x vocab) bool tensor is small at CPU
    batch sizes. GPU engines keep vLLM's compiled kernel."""
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = _count_at_least
