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

Non-finite input follows the project's rule, not torchao's: on a CPU :func:`mx_quantize` raises
:class:`fp8core.quant.NonFiniteInput`, elsewhere it sets the device's non-finite flag without a host read
(:func:`fp8core.quant.record_nonfinite`), as :func:`fp8core.quant.quantize` does; torchao writes the NaN scale byte
255 for a NaN block, and an inf block gets a finite scale and saturated elements.

The scale exponent is computed from the FP32 bits (floor) and with ``frexp`` (rceil) -- exact integer arithmetic, no
``log2`` rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import FP8_DTYPES, FP8_MAX, amax_groups
from .quant import NON_FINITE, NonFiniteInput, QuantizedTensor, record_nonfinite

__all__ = ["E8M0_BIAS", "MX_BLOCK", "MX_RULES", "MXTensor", "e8m0_bytes", "from_quantized", "mx_quantize",
           "mx_dequantize", "swizzle_scales", "mx_mm", "mx_linear"]

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
    amax = amax_groups(groups, -1) if groups.numel() else groups.new_zeros(groups.shape[:-1])
    if groups.numel():
        if xf.device.type == "cpu":
            if not bool(torch.isfinite(amax).all()):
                raise NonFiniteInput(NON_FINITE)
        else:  # no host read off the CPU: the device's flag, read where the caller syncs anyway (as quantize)
            record_nonfinite(amax.device, torch.isfinite(amax).all().logical_not())
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


def from_quantized(q: QuantizedTensor) -> MXTensor:
    """A 2-D operand in 1x32 groups (``group32``) with power-of-two scales -- the mxfp8 recipe's, from
    fp8core.quant -- as an MX tensor: K zero-padded to the block (code 0 is +0), each scale 2**e as its E8M0 byte
    e + 127 (frexp: exact, no host read)."""
    if q.granularity != "group32" or q.data.dim() != 2:
        raise ValueError(f"from_quantized: needs a 2-D group32 operand, got {q.granularity} {tuple(q.data.shape)}")
    rows, k = q.data.shape
    pad = -k % MX_BLOCK
    data = q.data.contiguous()  # row-major: mx_mm hands the second operand to torch transposed (column-major)
    data = torch.nn.functional.pad(data.view(torch.uint8), (0, pad)).view(data.dtype) if pad else data
    return MXTensor(data, e8m0_bytes(q.scale), q.fmt, MX_BLOCK)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two FP32 scales ``2**e`` as their E8M0 bytes ``e + 127`` (uint8; frexp: exact, no host read). A
    scale that is not a power of two in E8M0's range has no byte: callers that cannot vouch for theirs check the
    round trip (fp8core.serve.served_scale)."""
    _, e = torch.frexp(scale)  # scale = 0.5 x 2**e
    return (e - 1 + E8M0_BIAS).to(torch.uint8)


def mx_dequantize(q: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``element x 2**(code - 127)`` per block, in FP32, then ``dtype``."""
    d = q.data.to(torch.float32)
    groups = d.reshape(*d.shape[:-1], d.shape[-1] // q.block, q.block)
    scale = torch.ldexp(torch.ones(q.scale.shape, dtype=torch.float32, device=d.device),
                        q.scale.to(torch.int32) - E8M0_BIAS)
    return (groups * scale.unsqueeze(-1)).reshape(d.shape).to(dtype)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales ``[rows, K / 32]`` in the block-scaling layout cuBLAS reads for MX GEMMs (torch's
    ``SwizzleType.SWIZZLE_32_4_4``), flat: the scales padded with zeros to 128-row x 4-column tiles, tiles in row-major
    order, and inside a tile the element at (r, c) at byte ``(r % 32) * 16 + (r // 32) * 4 + c``."""
    rows, cols = scale.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    padded = scale.new_zeros(rt * 128, ct * 4)
    padded[:rows, :cols] = scale
    # [row tile, r // 32, r % 32, col tile, c] -> [row tile, col tile, r % 32, r // 32, c]
    tiles = padded.view(rt, 4, 32, ct, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def mx_mm(a: MXTensor, b: MXTensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b.T`` for ``a`` [M, K] and ``b`` [N, K], both MX along K (E4M3 or E5M2, 32-element blocks): one
    ``torch.nn.functional.scaled_mm`` call with 1x32 block scaling on both operands and swizzled E8M0 scales (Blackwell's
    MX GEMM; no host read, runs on the meta device). Where torch rejects the call as unsupported (a CPU, a GPU before
    SM100), the products of the dequantized operands in FP32 -- exact: each element times its power-of-two scale is an
    FP32 value -- summed in FP32."""
    from fp8core.scaled_mm import unsupported

    if a.block != MX_BLOCK or b.block != MX_BLOCK or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"mx_mm: need [M, K] and [N, K] in 32-element blocks, got {tuple(a.data.shape)} "
                         f"({a.block}) and {tuple(b.data.shape)} ({b.block})")
    import torch.nn.functional as F

    if hasattr(F, "scaled_mm") and hasattr(F.ScalingType, "BlockWise1x32"):
        n = b.data.shape[0]
        pad = -n % 16  # torch wants both of mat2's dimensions divisible by 16: zero rows (scale code 0), cropped after
        bd = torch.cat([b.data, b.data.new_zeros(pad, b.data.shape[1])]) if pad else b.data
        bs = torch.cat([b.scale, b.scale.new_zeros(pad, b.scale.shape[1])]) if pad else b.scale
        sa = swizzle_scales(a.scale).view(torch.float8_e8m0fnu)
        sb = swizzle_scales(bs).view(torch.float8_e8m0fnu)
        swz = F.SwizzleType.SWIZZLE_32_4_4
        try:
            out = F.scaled_mm(a.data, bd.t(), sa, F.ScalingType.BlockWise1x32, sb, F.ScalingType.BlockWise1x32,
                              swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype)
            return out[:, :n] if pad else out
        except (RuntimeError, NotImplementedError, ValueError) as e:
            if not unsupported(e):
                raise
    return (mx_dequantize(a) @ mx_dequantize(b).t()).to(out_dtype)


def _along_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [R, C] padded with zero columns to a multiple of the block (the tokens of a wgrad)."""
    pad = -t.shape[1] % MX_BLOCK
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, rule, grad_fmt):
        x2 = x.reshape(-1, x.shape[-1])
        y = mx_mm(mx_quantize(x2.contiguous(), rule=rule), mx_quantize(weight.contiguous(), rule=rule),
                  out_dtype=torch.float32)
        ctx.save_for_backward(x2, weight)
        ctx.rule, ctx.grad_fmt, ctx.shape = rule, grad_fmt, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.float32).contiguous()
        rule, gf = ctx.rule, ctx.grad_fmt
        # dgrad: contraction over N -- dY along N, the weight re-quantized along N
        dx = mx_mm(mx_quantize(dy2, fmt=gf, rule=rule), mx_quantize(weight.t().contiguous(), rule=rule),
                   out_dtype=torch.float32)
        # wgrad: contraction over the tokens -- dY^T and X^T along the tokens, padded to the block
        dw = mx_mm(mx_quantize(_along_rows(dy2.t()), fmt=gf, rule=rule),
                   mx_quantize(_along_rows(x2.to(torch.float32).t()), rule=rule), out_dtype=torch.float32)
        return dx.reshape(ctx.shape), dw.to(weight.dtype), None, None


def mx_linear(x: torch.Tensor, weight: torch.Tensor, *, rule: str = "floor", grad_fmt: str = "e4m3") -> torch.Tensor:
    """``x @ weight.T`` with MXFP8 GEMMs, forward and backward, each operand quantized along the dimension its GEMM
    contracts: the forward X and W along K; the dgrad dY along N and W re-quantized along N; the wgrad dY and X along
    the tokens (padded to 32). Elements E4M3, gradients ``grad_fmt`` (E5M2: the hybrid format); FP32 output."""
    if x.shape[-1] % MX_BLOCK or weight.shape[0] % MX_BLOCK or weight.shape[1] % MX_BLOCK:
        raise ValueError(f"mx_linear: K and N must be multiples of {MX_BLOCK}, got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    return _MXLinearFn.apply(x, weight, rule, grad_fmt)
