"""Model conversion: put the decoder layers' linears of a Hugging Face causal LM on FP8.

What changes: every ``nn.Linear`` inside ``model.model.layers[i]`` for the FP8 layers ``i`` (for Qwen3 / Llama:
``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``) becomes an :class:`fp8core.linear.FP8Linear` that
shares the original ``weight`` / ``bias`` Parameter objects -- state_dict keys, optimizer state and weight tying are
untouched. In Mixture-of-Experts layers the fused experts (``mlp.experts``) become :class:`fp8core.moe.FP8Experts`
(each expert's gate / up / down an FP8 GEMM); routers are not linears and stay high precision (fp8core/moe.py). What stays in high precision: embeddings, ``lm_head``, all norms, attention math (softmax, RoPE) and the
first / last decoder layers the caller asks to keep (FP8 errors hurt most at the model's ends).

The model is duck-typed (``model.model.layers`` as for ``*ForCausalLM``, or ``model.layers`` for a bare decoder),
so fp8core needs no transformers import. :func:`fp8_layer_indices` is the one rule for which layers run in FP8;
the vLLM plugin reuses it so rollouts and training agree.

:func:`high_precision` runs the same master weights without FP8 (the BF16 "shadow" forward that Calibrated
Clipping compares against).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from fp8core.layers import decoder_layers
from fp8core.linear import FP8Linear, FP8LinearConfig
from fp8core.moe import FP8Experts, convert_experts

__all__ = ["convert_to_fp8", "decoder_layers", "fp8_layer_indices", "fp8_modules", "high_precision"]


def fp8_layer_indices(num_layers: int, first: int = 0, last: int = 0) -> list[int]:
    """Indices of the decoder layers that run in FP8 when the first ``first`` and last ``last`` stay in BF16:
    ``range(first, num_layers - last)``."""
    for name, value in (("num_layers", num_layers), ("num_first_layers_in_bf16", first),
                        ("num_last_layers_in_bf16", last)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if first + last > num_layers:
        raise ValueError(f"num_first_layers_in_bf16 ({first}) + num_last_layers_in_bf16 ({last}) = {first + last} "
                         f"exceeds the model's {num_layers} decoder layers")
    return list(range(first, num_layers - last))


def convert_to_fp8(model: nn.Module, config: FP8LinearConfig, *, num_first_layers_in_bf16: int = 0,
                   num_last_layers_in_bf16: int = 0) -> list[str]:
    """Swap the nn.Linear modules of the FP8 decoder layers for FP8Linear (in place); return their dotted names.

    Modules that are already FP8Linear get ``config`` and are listed again (converting twice is harmless).
    """
    if not isinstance(config, FP8LinearConfig):
        raise ValueError(f"convert_to_fp8: config must be an FP8LinearConfig, got {type(config).__name__}")
    prefix, layers = decoder_layers(model)
    converted: list[str] = []
    for i in fp8_layer_indices(len(layers), num_first_layers_in_bf16, num_last_layers_in_bf16):
        for name, module in list(layers[i].named_modules()):
            if not isinstance(module, nn.Linear) or not name:
                continue
            if isinstance(module, FP8Linear):
                module.config = config
            else:
                parent_name, _, child = name.rpartition(".")
                parent = layers[i].get_submodule(parent_name) if parent_name else layers[i]
                setattr(parent, child, FP8Linear.from_linear(module, config))
            converted.append(f"{prefix}.{i}.{name}")
    converted += convert_experts(model, config, fp8_layer_indices(len(layers), num_first_layers_in_bf16,
                                                                 num_last_layers_in_bf16))
    if converted:
        from fp8core import kernels

        kernels.load()  # build/load the fused quantize kernel now (logged), not inside the first training step
    return converted


def fp8_modules(model: nn.Module) -> Iterator[tuple[str, FP8Linear]]:
    """(name, module) for every FP8Linear in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            yield name, module


@contextlib.contextmanager
def high_precision(model: nn.Module):
    """Run ``model``'s FP8Linear layers as plain linears on the same master weights inside the block; the previous
    per-module switches are restored on exit (also on error)."""
    previous = [(m, m.fp8_enabled) for _, m in fp8_modules(model)]
    previous += [(m, m.fp8_enabled) for m in model.modules() if isinstance(m, FP8Experts) and m.config is not None]
    try:
        for m, _ in previous:
            m.fp8_enabled = False
        yield model
    finally:
        for m, enabled in previous:
            m.fp8_enabled = enabled
