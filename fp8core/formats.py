"""The FP8 formats' constants, the scale floor and the scale rule, shared by the quantizer's modules (fp8core.quant,
which documents the conventions and re-exports these, fp8core.quant_chunked, fp8core.shard, fp8core.mx)."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
GROUP = 128
# 1 x n groups along the last dimension, by name: 1x128 (DeepSeek-V3's activations), 1x32 (MXFP8's blocks)
GROUP_SIZES = {"group128": GROUP, "group32": 32}
GRANULARITIES = ("tensorwise", "rowwise", "group128", "group32", "block128")
FORMATS = ("e4m3", "e5m2")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
MIN_SCALE = 2.0**-126  # smallest normal FP32: the floor applied to every scale

NON_FINITE = ("quantize: input contains non-finite values (inf or nan, or beyond the FP32 range); "
              "FP8 scales cannot be computed from them")


class NonFiniteInput(ValueError):
    """What the quantizer raises on non-finite input (message :data:`NON_FINITE`); a ValueError, so callers that
    catch those see it as before, and a caller that must not raise mid-computation (the engine's op,
    rollout/engine_ops.py) can tell it from every other error."""


def _round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale (scale > 0, finite), exactly: frexp gives scale = m * 2**e with m in [0.5, 1)."""
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def amax_groups(v: torch.Tensor, dims) -> torch.Tensor:
    """The largest magnitude over ``dims`` as max(amax, -amin): two fast reductions and no |x| temporary; both
    propagate NaN, and inf shows up as inf."""
    return torch.maximum(v.amax(dim=dims), v.amin(dim=dims).neg())


def scale_from_amax(amax: torch.Tensor, fp8_max: float, pow2: bool) -> torch.Tensor:
    """The quantizer's scale rule: ``max(amax / fp8_max, 2**-126)``, rounded up to a power of two with ``pow2``."""
    scale = torch.clamp(amax / fp8_max, min=MIN_SCALE)
    return _round_up_pow2(scale) if pow2 else scale
