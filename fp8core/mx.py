"""MXFP8 quantization (OCP Microscaling v1.0): blocks of 32 elements along the last (contraction) dimension share
one power-of-two scale stored as E8M0 (a biased exponent byte: ``scale = 2**(code - 127)``), elements in E4M3 (E5M2
for gradients in the hybrid format). Blackwell's native FP8 recipe.

Two scale rules (``rule``):

* ``floor`` -- the OCP specification's: ``2**(floor(log2(amax)) - emax)``, emax the element format's largest
  exponent (8 for E4M3, 15 for E5M2). A block's largest element can land above the format's largest value
  (E4M3: up to 1.75 x 2**8 = 448 ... 480 would be 1.875 x 2**8) and is then saturated;
* ``rceil`` -- NVIDIA's (cuBLAS, Transformer Engine, the ``cvt.rp`` instruction): ``2**ceil(log2(amax / max))``, the
  smallest power of two that keeps every element within the format; nothing saturates.

Elements are ``x / scale`` (``x * 2**-k`` for rceil), clamped to the format's range and rounded to nearest even by the
cast, so both rules give torchao's ``to_mx`` codes and scale bytes bit for bit on finite input, including its edge
cases: the E8M0 exponent range is clamped to [-127, 127] (floor: [-127, 128]), a floor scale below the smallest
normal FP32 divides by 2**-126, and an rceil scale code 0 (amax / max <= 2**-127) multiplies by 1
(tests/fp8core/test_mx.py compares them on random, subnormal, zero, saturating and extreme-exponent tensors).

Non-finite input follows the project's rule, not torchao's: :func:`mx_quantize` raises
:class:`fp8core.quant.NonFiniteInput` (torchao writes the NaN scale byte 255 for a NaN block, and an inf block gets a
finite scale and saturated elements), as :func:`fp8core.quant.quantize` does.

The scale exponent is computed from the FP32 bits (floor) and with ``frexp`` (rceil) -- exact integer arithmetic, no
``log2`` rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import FP8_DTYPES, FP8_MAX
from .quant import NON_FINITE, NonFiniteInput

__all__ = ["MX_BLOCK", "MX_RULES", "MXTensor", "mx_quantize", "mx_dequantize"]

MX_BLOCK = 32
MX_RULES = ("floor", "rceil")
E8M0_BIAS = 127
_EMAX = {"e4m3": 8, "e5m2": 15}  # the element format's largest exponent (E4M3: 448 = 1.75 x 2**8)


@dataclass(frozen=True)
class MXTensor:
    """``data``: FP8 elements, the input's shape; ``scale``: E8M0 bytes (uint8), ``[..., K / block]``."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str = "e4m3"
    block: int = MX_BLOCK

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mx_dequantize(self, dtype)


def _check(x: torch.Tensor, fmt: str, rule: str, block: int) -> None:
    if fmt not in _EMAX:
        raise ValueError(f"fmt={fmt!r} is not supported for MX; allowed: {', '.join(_EMAX)}")
    if rule not in MX_RULES:
        raise ValueError(f"rule={rule!r} is not supported; allowed: {', '.join(MX_RULES)}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mx_quantize: x must be a float32 or bfloat16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"mx_quantize: the last dimension of {tuple(x.shape)} must be a multiple of the block, {block}")


def _floor_exponent(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """floor(log2(amax)) - emax from amax's FP32 exponent bits (a subnormal or zero amax reads as -127)."""
    e = torch.bitwise_right_shift(amax.view(torch.int32), 23).bitwise_and(0xFF) - E8M0_BIAS
    return (e - emax).clamp(-E8M0_BIAS, E8M0_BIAS + 1)


def _rceil_exponent(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """ceil(log2(amax / max)), exactly: ``frexp`` gives d = m x 2**E with m in [0.5, 1), so ceil(log2 d) is E - 1
    when m is exactly 0.5 (d a power of two) and E otherwise; zero reads as -127."""
    d = amax / fp8_max
    m, e = torch.frexp(d)
    up = torch.where(m == 0.5, e - 1, e)
    return torch.where(d > 0, up, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)


def mx_quantize(x: torch.Tensor, *, fmt: str = "e4m3", rule: str = "floor", block: int = MX_BLOCK) -> MXTensor:
    """MX blocks of ``block`` elements along the last dimension of ``x`` (module docstring)."""
    _check(x, fmt, rule, block)
    xf = x.detach().to(torch.float32)
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // block, block)
    amax = torch.maximum(groups.amax(-1), groups.amin(-1).neg()) if groups.numel() else groups.new_zeros(groups.shape[:-1])
    if groups.numel() and not bool(torch.isfinite(amax).all()):
        raise NonFiniteInput(NON_FINITE)
    fp8_max = FP8_MAX[fmt]
    if rule == "floor":
        k = _floor_exponent(amax, _EMAX[fmt])
        scale = torch.ldexp(torch.ones_like(amax), k).clamp_min(2.0**-126)  # 2**-127 divides as 2**-126 (torchao)
        scaled = groups / scale.unsqueeze(-1)
    else:
        k = _rceil_exponent(amax, fp8_max)
        inverse = torch.where(k == -E8M0_BIAS, 1.0, torch.ldexp(torch.ones_like(amax), -k))  # code 0: x 1 (torchao)
        scaled = groups * inverse.unsqueeze(-1)
    data = scaled.clamp_(-fp8_max, fp8_max).to(FP8_DTYPES[fmt]).reshape(x.shape)
    return MXTensor(data, (k + E8M0_BIAS).to(torch.uint8), fmt, block)


def mx_dequantize(q: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``element x 2**(code - 127)`` per block, in FP32, then ``dtype``."""
    d = q.data.to(torch.float32)
    groups = d.reshape(*d.shape[:-1], d.shape[-1] // q.block, q.block)
    scale = torch.ldexp(torch.ones(q.scale.shape, dtype=torch.float32, device=d.device),
                        q.scale.to(torch.int32) - E8M0_BIAS)
    return (groups * scale.unsqueeze(-1)).reshape(d.shape).to(dtype)
