"""The CPU FP8 GEMM: ``torch.ops.fp8core.fp8_gemm`` (fp8core/csrc/gemm.cpp), the one GEMM the trainer's FP8 linears
and the rollout engine's FP8 layers call on a CPU.

Numerics. ``C[m, n] = sum_kb (sa[m, kb] * sb[n, kb]) * P_kb[m, n]`` with ``P_kb`` the FP32 sum of the code
products of K block ``kb``. Every E4M3 / E5M2 value is a normal BF16 number and the product of two is exact in FP32,
so BF16-unit dot products with FP32 accumulation compute ``P_kb`` exactly up to the order of the additions. A K
block is 128 columns when either operand is blockwise (group128 / block128), else all of K: rowwise and tensorwise
are one GEMM over the codes, then ``(sa * sb) * P``. The scale product is rounded to FP32, then fused into the
accumulator (``acc = fma(P_kb, sa * sb, acc)``, blocks in increasing order). Inside a block:

* AVX-512 BF16 (and AMX CPUs, which have it): VDPBF16PS, one pair of K columns per instruction per output
  (``acc += a[2p] * b[2p] + a[2p+1] * b[2p+1]``), pairs in increasing order;
* AVX2 / AVX-512 without BF16 units: FP32 FMAs, one K column at a time, in increasing order.

The order depends on neither M nor the tiling nor the thread count, so a row's output is the same alone or inside
any batch (bit for bit, within one CPU kind). Across kinds the order inside a block differs (pairs vs single
columns; VDPBF16PS's internal rounding of the pair is the hardware's), so kinds agree within the FP32 summation
bound of the float64 reference, not bit for bit. The operation is registered with ``torch.library`` (schema in the
C++ source, a fake kernel here) so it can be traced; it runs wherever fp8core/csrc builds (x86-64 Linux, AVX2 or
better; fp8core.kernels).

Activations whose quantization groups are the GEMM's K blocks (group128 against 128-column blocks, rowwise against
one block of all of K) are quantized inside the op, straight into its packed layout
(:func:`fp8_quant_gemm_packed`): the same scales and products as ``quantize()`` then :func:`fp8_gemm_packed`,
without an FP8 code tensor or a conversion pass.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fp8core import kernels
from fp8core.quant import GROUP, GROUP_SIZES, NON_FINITE, NonFiniteInput, QuantizedTensor

__all__ = ["PackedWeight", "available", "block_for", "describe", "fp8_gemm", "fp8_gemm_packed", "fp8_gemm_rows",
           "fp8_quant_gemm_packed", "pack_weight", "path", "quantizes_into_pack", "row_scales"]

_FMT_INDEX = {"e4m3": 0, "e5m2": 1}
_BLOCKWISE = ("group128", "block128")
_fake_registered = False


def available() -> bool:
    """Whether the op is loaded in this process (the kernel library built for this CPU kind)."""
    global _fake_registered
    if kernels.load() is None:
        return False
    if not _fake_registered:
        lanes = kernels.load().fp8_gemm_lanes()
        value_dtype = torch.int16 if lanes == 16 else torch.float32  # BF16 bits / FP32 values (the build's layout)

        def packed_sizes(n, k, block):
            block = min(block, max(k, 1))
            nkb = -(-k // block) if k else 0
            tiles = -(-n // lanes)
            return tiles * nkb * (block + block % 2) * lanes, tiles * nkb * lanes

        @torch.library.register_fake("fp8core::fp8_gemm")
        def _(a, a_fmt, a_scale, b, b_fmt, b_scale, block):
            return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)

        @torch.library.register_fake("fp8core::fp8_pack")
        def _(b, b_fmt, b_scale, block):
            values, scales = packed_sizes(b.shape[0], b.shape[1], block)
            return b.new_empty((values,), dtype=value_dtype), b.new_empty((scales,), dtype=torch.float32)

        @torch.library.register_fake("fp8core::fp8_gemm_packed")
        def _(a, a_fmt, a_scale, b_values, b_scales, n, block):
            return a.new_empty((a.shape[0], n), dtype=torch.float32)

        @torch.library.register_fake("fp8core::fp8_quant_gemm_packed")
        def _(x, a_fmt, pow2, b_values, b_scales, n, block):
            nkb = -(-x.shape[1] // min(block, max(x.shape[1], 1))) if x.shape[1] else 0
            return (x.new_empty((x.shape[0], n), dtype=torch.float32),
                    x.new_empty((x.shape[0], nkb), dtype=torch.float32), x.new_empty((), dtype=torch.float32))

        _fake_registered = True
    return True


def path() -> str:
    """The GEMM path compiled for this CPU kind, or why there is none."""
    mod = kernels.load()
    return mod.fp8_gemm_path() if mod is not None else f"none ({kernels.describe()})"


def describe() -> str:
    """The run's CPU line: this CPU, the cap (fp8core.cpu) and the FP8 GEMM path built for it. Logged at the start
    of every run; ``python -m fp8core`` prints it."""
    from fp8core.cpu import describe as cpu_line

    return f"{cpu_line()}; FP8 GEMM {path()}"


def block_for(a_granularity: str, b_granularity: str, k: int) -> int:
    """The K block of the GEMM: 32 when either operand is in 1x32 groups (MXFP8), 128 when either is blockwise,
    else all of K (one block)."""
    if "group32" in (a_granularity, b_granularity):
        return GROUP_SIZES["group32"]
    return GROUP if a_granularity in _BLOCKWISE or b_granularity in _BLOCKWISE else max(1, k)


def row_scales(q: QuantizedTensor, block: int) -> torch.Tensor:
    """``q``'s scales per row and K block, FP32 ``[rows, ceil(K / block)]`` (what the op reads)."""
    rows, k = q.data.shape
    nkb = -(-k // block) if k else 0
    s = q.scale.to(torch.float32)
    if q.granularity == "tensorwise":
        return s.reshape(1, 1).expand(rows, nkb).contiguous()
    if q.granularity == "rowwise":
        return s.reshape(rows, 1).expand(rows, nkb).contiguous()
    need = GROUP_SIZES.get(q.granularity, GROUP)
    if block != need:
        raise ValueError(f"row_scales: a {q.granularity} operand needs K blocks of {need}, got {block}")
    if q.granularity in GROUP_SIZES:
        return s.reshape(rows, nkb).contiguous()
    return s.repeat_interleave(GROUP, 0)[:rows].contiguous()  # block128: each row takes its tile row's scales


def fp8_gemm_rows(a_codes: torch.Tensor, a_fmt: str, a_rows: torch.Tensor, b_codes: torch.Tensor, b_fmt: str,
                  b_rows: torch.Tensor, block: int) -> torch.Tensor:
    """FP32 ``[M, N]`` from FP8 codes ``a [M, K]``, ``b [N, K]`` and their per-row block scales (:func:`row_scales`)."""
    return torch.ops.fp8core.fp8_gemm(a_codes.view(torch.uint8), _FMT_INDEX[a_fmt], a_rows,
                                      b_codes.view(torch.uint8), _FMT_INDEX[b_fmt], b_rows, block)


class PackedWeight(NamedTuple):
    """A weight-side operand packed once for the op (``pack_weight``): its values in this build's layout and its
    scales by tile; ``n`` rows, contracted in K blocks of ``block``. Holds 2 bytes per weight (BF16 pairs) on CPUs
    with BF16 units, 4 (FP32) elsewhere."""

    values: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    block: int

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * self.scales.element_size()


def pack_weight(codes: torch.Tensor, fmt: str, rows: torch.Tensor, block: int) -> PackedWeight:
    """Pack FP8 ``codes [N, K]`` with their per-row block scales (``row_scales``) for :func:`fp8_gemm_packed`: done
    once per refit (the engine) or per optimizer update (the trainer's WeightCache), not per call."""
    values, scales = torch.ops.fp8core.fp8_pack(codes.view(torch.uint8), _FMT_INDEX[fmt], rows, block)
    return PackedWeight(values, scales, codes.shape[0], codes.shape[1], block)


def fp8_gemm_packed(a_codes: torch.Tensor, a_fmt: str, a_rows: torch.Tensor, b: PackedWeight) -> torch.Tensor:
    """FP32 ``[M, N]``: ``a [M, K]`` (codes and per-row block scales) times the packed weight ``b``, transposed.
    Bit for bit :func:`fp8_gemm_rows` on the codes ``b`` was packed from."""
    if a_codes.shape[-1] != b.k:
        raise ValueError(f"fp8_gemm_packed: a has K = {a_codes.shape[-1]}, the packed weight K = {b.k}")
    return torch.ops.fp8core.fp8_gemm_packed(a_codes.view(torch.uint8), _FMT_INDEX[a_fmt], a_rows, b.values,
                                             b.scales, b.n, b.block)


def quantizes_into_pack(granularity: str, b: PackedWeight) -> bool:
    """Whether activations of ``granularity`` can be quantized inside the op against ``b`` (their groups are the
    GEMM's K blocks: group128 / group32 against blocks of 128 / 32 columns, rowwise against one block of all of K)."""
    return b.block == GROUP_SIZES.get(granularity) or (granularity == "rowwise" and b.block >= b.k)


def fp8_quant_gemm_packed(x: torch.Tensor, fmt: str, b: PackedWeight, *, pow2: bool = False) -> torch.Tensor:
    """FP32 ``[M, N]``: ``x [M, K]`` (FP32 / BF16) quantized along K in groups of ``b``'s K block (see
    :func:`quantizes_into_pack`) straight into the op's packed layout, times ``b`` transposed -- no FP8 code tensor,
    one pass over ``x``. Bit for bit ``fp8_gemm_packed`` on ``quantize(x)``'s codes and scales; non-finite input
    raises quantize's ValueError."""
    if x.shape[-1] != b.k:
        raise ValueError(f"fp8_quant_gemm_packed: x has K = {x.shape[-1]}, the packed weight K = {b.k}")
    x2 = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(torch.float32)
    y, _, amax = torch.ops.fp8core.fp8_quant_gemm_packed(x2.contiguous(), _FMT_INDEX[fmt], pow2, b.values, b.scales,
                                                         b.n, b.block)
    if not math.isfinite(float(amax)):
        raise NonFiniteInput(NON_FINITE)
    return y


def fp8_gemm(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """FP32 ``a @ b.T`` for ``a [M, K]``, ``b [N, K]`` quantized along K (module docstring)."""
    if not available():
        raise RuntimeError(f"the CPU FP8 GEMM is not available: {kernels.describe()}")
    block = block_for(a.granularity, b.granularity, a.data.shape[1])
    return fp8_gemm_rows(a.data, a.fmt, row_scales(a, block), b.data, b.fmt, row_scales(b, block), block)
