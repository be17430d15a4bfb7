"""Where a model keeps its decoder layers: ``model.model.layers`` (``*ForCausalLM``) or ``model.layers`` (a bare
decoder). Duck-typed, so fp8core needs no transformers import.

The lowest piece of model conversion: the dense conversion (fp8core/convert.py) and the Mixture-of-Experts one
(fp8core/moe.py) both walk the layers through :func:`decoder_layers`, and convert.py calls into moe.py (never the
other way round).
"""
from __future__ import annotations

from torch import nn

__all__ = ["decoder_layers"]


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layer list and its dotted prefix: ``model.model.layers`` (causal LM) or ``model.layers``."""
    inner = getattr(model, "model", None)
    for prefix, owner in (("model.layers", inner), ("layers", model)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, nn.ModuleList):
            return prefix, layers
    raise ValueError(f"convert_to_fp8: {type(model).__name__} has no decoder layer list (expected "
                     f"`model.model.layers` or `model.layers`, an nn.ModuleList)")
