"""One FP8 numerics spec for both sides of end-to-end FP8: the trainer's FP8 conversion and the rollout engine's
quantization config are built from the same :class:`FP8Spec`, so they cannot drift apart.

===========================  ===============================================================================
field                        meaning
===========================  ===============================================================================
recipe                       blockwise (1x128 activations, 128x128 weights) | rowwise | tensorwise | mxfp8 (1x32
                             groups along K for every operand, power-of-two scales: OCP MXFP8, Blackwell's format)
fmt                          e4m3 | hybrid (E5M2 output gradients; training only -- forward numerics are E4M3)
pow2_weight                  weight scales rounded up to powers of two
pow2_activation              activation (and gradient) scales rounded up to powers of two
num_first_layers_in_bf16     first decoder layers kept in high precision
num_last_layers_in_bf16      last decoder layers kept in high precision
backend                      auto | cpu | emulated | scaled_mm (which kernel computes the GEMM: the same products,
                             summed in another order, so part of the forward numerics)
===========================  ===============================================================================

:meth:`FP8Spec.forward_key` is what a rollout engine and a trainer must share for their forward passes to be
identical (everything but the gradient format, which only the backward uses).
"""
from __future__ import annotations

from dataclasses import dataclass

from fp8core.convert import fp8_layer_indices
from fp8core.linear import BACKENDS, LINEAR_FORMATS, RECIPES, FP8LinearConfig, weight_granularity

__all__ = ["FORWARD_FIELDS", "FP8Spec"]

FORWARD_FIELDS = ("recipe", "pow2_weight", "pow2_activation", "num_first_layers_in_bf16", "num_last_layers_in_bf16",
                  "backend")


@dataclass(frozen=True)
class FP8Spec:
    recipe: str = "blockwise"
    fmt: str = "e4m3"
    pow2_weight: bool = False
    pow2_activation: bool = False
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    backend: str = "auto"

    def __post_init__(self):
        for name, allowed in (("recipe", RECIPES), ("fmt", LINEAR_FORMATS), ("backend", BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FP8Spec.{name}={getattr(self, name)!r} is not one of {allowed}")
        for name in ("pow2_weight", "pow2_activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8Spec.{name} must be a bool, got {getattr(self, name)!r}")
            if self.recipe == "mxfp8" and not getattr(self, name):
                raise ValueError(f"FP8Spec.{name}=False: recipe 'mxfp8' has power-of-two (E8M0) scales; set it true")
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FP8Spec.{name} must be an int >= 0, got {value!r}")

    @property
    def weight_granularity(self) -> str:
        return weight_granularity(self.recipe)

    def linear_config(self) -> FP8LinearConfig:
        """The trainer's FP8Linear settings."""
        return FP8LinearConfig(recipe=self.recipe, fmt=self.fmt, pow2_weight=self.pow2_weight,
                               pow2_activation=self.pow2_activation, backend=self.backend)

    def convert(self, model) -> list[str]:
        """Convert ``model``'s decoder linears to :class:`FP8Linear` with this spec's numerics (the FP8 layers only);
        returns the converted module names (``fp8core.convert.convert_to_fp8``)."""
        from fp8core.convert import convert_to_fp8

        return convert_to_fp8(model, self.linear_config(), num_first_layers_in_bf16=self.num_first_layers_in_bf16,
                              num_last_layers_in_bf16=self.num_last_layers_in_bf16)

    def layer_indices(self, num_layers: int) -> list[int]:
        """Decoder layers that run in FP8."""
        return fp8_layer_indices(num_layers, self.num_first_layers_in_bf16, self.num_last_layers_in_bf16)

    def forward_key(self) -> tuple:
        """The fields that decide the forward numerics (must agree between engine and trainer)."""
        return tuple(getattr(self, f) for f in FORWARD_FIELDS)
