"""What a serving engine holds for a model trained with FP8 linears: the *served* state dict.

For every :class:`fp8core.linear.FP8Linear` the forward weight quantization of its recipe
(``FP8Linear.quantized_weight()``: E4M3 codes + FP32 dequantization scales) under the Hugging Face names
``<module>.weight`` (float8_e4m3fn) and ``<module>.weight_scale_inv`` (FP32; shape per recipe: block128
``[ceil(N/128), ceil(K/128)]``, rowwise ``[N, 1]``, tensorwise ``[]``; mxfp8's 1x32 groups ``[N, ceil(K/32)]`` as E8M0,
one byte each, see :func:`served_scale_dtype`) -- vLLM's name for a dequantization scale.
Every other tensor (embeddings, norms, lm_head, biases, BF16-kept layers) in ``hp_dtype``; MoE routers
(:class:`fp8core.moe.FP32Router`) in FP32, the precision both sides compute their logits in. Fused MoE experts
are served under their checkpoint names, one expert and projection at a time (``<...>.experts.<e>.gate_proj.weight``
+ ``weight_scale_inv``, :func:`fp8core.moe.checkpoint_state_dict`), FP8 for :class:`fp8core.moe.FP8Experts`.

The rollout engine loads this without re-quantizing (FP8 over the wire at refit; an exported FP8 checkpoint), so
it holds exactly the trainer's quantization: half the bytes of a BF16 refit for the FP8 layers, and no second
quantizer that could drift from the trainer's.
"""
from __future__ import annotations

import torch
from torch import nn

from fp8core.linear import FP8Linear, WeightCache
from fp8core.moe import PARTS, FP8Experts, FP32Router, checkpoint_state_dict
from fp8core.mx import e8m0_bytes

__all__ = ["SCALE_SUFFIX", "served_recipes", "served_scale", "served_scale_dtype", "served_state_dict",
           "scale_from_served"]

SCALE_SUFFIX = "_scale_inv"  # <module>.weight -> <module>.weight_scale_inv


def served_scale_dtype(granularity: str) -> torch.dtype:
    """The dtype a weight's dequantization scales are served in: E8M0 (``float8_e8m0fnu``, one byte, ``2**(code -
    127)``) for MX's 1x32 groups, whose scales the recipe makes powers of two -- 1/32 of a byte per weight instead of
    1/8 -- and FP32 for every other granularity."""
    return torch.float8_e8m0fnu if granularity == "group32" else torch.float32


def served_scale(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """``scale`` (FP32) in its served dtype; an E8M0 scale must be exact (a power of two in E8M0's range)."""
    dtype = served_scale_dtype(granularity)
    if dtype == torch.float32:
        return scale.float()
    out = e8m0_bytes(scale.float()).view(dtype)
    if not torch.equal(out.float(), scale.float()):
        raise ValueError(f"{granularity} scales are served as E8M0 and must be powers of two in [2**-127, 2**127]; "
                         "quantize with power-of-two scales (mxfp8 requires them)")
    return out


def scale_from_served(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """A served scale back in its dtype (``served_scale_dtype``) from its bytes, as a pickled or wired refit
    carries float8 tensors (uint8); any other tensor as it is."""
    dtype = served_scale_dtype(granularity)
    return scale.view(dtype) if scale.dtype == torch.uint8 and dtype.itemsize == 1 else scale


def served_recipes(model: nn.Module) -> tuple[dict[str, object], set[str]]:
    """``(recipes, fp32)``: the FP8 recipe (``FP8LinearConfig``) of every served name that is FP8 -- each FP8Linear's
    ``<module>.weight``, each FP8Experts' per-expert checkpoint names -- and the names served in FP32 (MoE routers);
    every other name is served in the high-precision dtype."""
    recipes = {f"{name}.weight": m.config for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    for name, m in model.named_modules():
        if isinstance(m, FP8Experts) and m.config is not None:
            recipes.update({f"{name}.{e}.{part}_proj.weight": m.config
                            for e in range(m.num_experts) for part in PARTS})
    fp32 = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, FP32Router)}
    return recipes, fp32


@torch.no_grad()
def served_state_dict(model: nn.Module, *, hp_dtype: torch.dtype = torch.bfloat16,
                      state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors: FP8 codes + scales (in :func:`served_scale_dtype`) for the FP8 linears' weights,
    ``hp_dtype`` copies for the rest.
    ``state``: the model's full state dict where ``model.state_dict()`` would not give it (a sharded model: the
    full weights gathered to one rank, trainer/dp.py). The codes are quantized from the state's tensors with each
    layer's own recipe (the layer's ``quantized_weight()`` of the same values), so a sharded model's layers need
    not be gathered."""
    recipes, fp32 = served_recipes(model)
    out: dict[str, torch.Tensor] = {}
    for name, t in checkpoint_state_dict(model.state_dict() if state is None else state).items():
        config = recipes.get(name)
        if config is None:
            out[name] = t.detach().to("cpu", torch.float32 if name in fp32 else hp_dtype).clone()
        else:
            q = WeightCache().get(t, config)[0]
            out[name] = q.data.detach().cpu().clone()
            out[name + SCALE_SUFFIX] = served_scale(q.scale.detach().cpu(), q.granularity).clone()
    return out
