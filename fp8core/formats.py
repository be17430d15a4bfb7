"""The FP8 formats' constants and the scale floor, shared by the quantizer's modules (fp8core.quant, which documents
the conventions and re-exports these, and fp8core.quant_chunked)."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
GROUP = 128
GRANULARITIES = ("tensorwise", "rowwise", "group128", "block128")
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
