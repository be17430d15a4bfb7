"""The quantizer's torch-ops path on a CPU (where fp8core's C++ kernel does not run): quantize, quantize-dequantize
and the column quantization of the wgrad operands in cache-sized row chunks, and the FP8 -> FP32 table. fp8core.quant
calls it; its arithmetic is quantize_reference's, bit for bit (tests/fp8core/test_quant.py).
"""
from __future__ import annotations

import math

import torch

from fp8core.formats import (
    FP8_DTYPES,
    FP8_MAX,
    GROUP,
    GROUP_SIZES,
    NON_FINITE,
    NonFiniteInput,
    amax_groups,
    scale_from_amax,
)

# The same arithmetic as quantize_reference (FP32 copy, max(amax, -amin) per group, one FP32 division by the scale,
# clamp, torch's cast), done on row chunks of ~_CHUNK_BYTES in two reused buffers that stay in cache: the whole-tensor
# version allocates and page-faults several FP32 temporaries the size of the input, which made it ~40x slower than a
# copy. Every element goes through identical IEEE operations, so the results are bit-identical (tested).
_CHUNK_BYTES = 1 << 20


_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _fp8_to_fp32_table(fmt: str, device: torch.device) -> torch.Tensor:
    """The FP32 value of each of the 256 FP8 codes, from torch's own cast (so a lookup equals ``.to(float32)`` bit for
    bit; on CPU the lookup is ~5x faster than torch's per-element FP8 -> FP32 conversion)."""
    key = (fmt, torch.device(device))
    if key not in _LUTS:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _LUTS[key] = codes.view(FP8_DTYPES[fmt]).to(torch.float32).to(device)
    return _LUTS[key]


def _fp8_to_fp32(data: torch.Tensor) -> torch.Tensor:
    """``data.to(float32)`` for FP8 ``data`` (any layout); contiguous result. Table lookup on CPU."""
    if data.device.type != "cpu":
        return data.to(torch.float32)
    fmt = "e4m3" if data.dtype == torch.float8_e4m3fn else "e5m2"
    idx = data.view(torch.uint8).to(torch.int32, memory_format=torch.contiguous_format).reshape(-1)
    return torch.index_select(_fp8_to_fp32_table(fmt, data.device), 0, idx).reshape(data.shape)


_GRID = {"e4m3": (3, -9), "e5m2": (2, -16)}  # mantissa bits, exponent of the smallest subnormal


def _round_to_fp8_grid_(b: torch.Tensor, ib: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round FP32 ``b`` (finite, |b| <= fp8_max) in place to the nearest FP8 value, ties to even -- the value
    ``b.to(fp8).to(float32)`` gives, bit for bit (signed zeros included; tested against torch's cast), in FP32
    arithmetic: the FP8 spacing at ``b`` is ``ulp = 2**(exponent(b) - mantissa_bits)``, at least the smallest
    subnormal, and ``round(b / ulp) * ulp`` is exact (a power-of-two division, torch's round-half-even, a
    power-of-two product). ``ib``: an int32 scratch tensor of b's shape. Six vectorized passes instead of torch's
    per-element FP8 casts (~4x faster on CPU)."""
    mbits, min_exp = _GRID[fmt]
    torch.bitwise_and(b.view(torch.int32), 0x7F800000, out=ib)
    ib.sub_(mbits << 23).clamp_(min=(min_exp + 127) << 23)
    ulp = ib.view(torch.float32)
    return b.div_(ulp).round_().mul_(ulp)


class _SingleThread:
    """Run the chunk loops on one intra-op thread: each op touches <= ~1 MB, too little to split, and with 2+ threads
    every op pays a thread barrier (measured: tiny Qwen3 FP8 fwd+bwd 3.8x FP32 at 2 threads on a loaded 2-core box,
    1.36x at 1 thread). Restores the caller's thread count."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        if self.n > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.n > 1:
            torch.set_num_threads(self.n)


def _quantize_2d(x2: torch.Tensor, granularity: str, fmt: str, pow2: bool, *, want_data: bool,
                 want_dq: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Chunked quantize of a 2-D ``[M, K]`` tensor (M, K > 0): (data or None, scale [M or Mb, G or 1 or ()],
    dequantized FP32 values or None)."""
    m, k = x2.shape
    fp8_max, dt, dev = FP8_MAX[fmt], FP8_DTYPES[fmt], x2.device
    width = GROUP_SIZES.get(granularity, GROUP)  # the groups' width along K (block128: 128)
    grouped = granularity in GROUP_SIZES or granularity == "block128"
    g = -(-k // width) if grouped else 1
    kp = g * width if grouped else k
    rows = max(1, _CHUNK_BYTES // (kp * 4))
    if granularity == "block128":
        rows = max(GROUP, rows // GROUP * GROUP)
    rows = min(rows, -(-m // GROUP) * GROUP if granularity == "block128" else m)
    buf = torch.zeros(rows, kp, dtype=torch.float32, device=dev)  # zero padding columns stay zero throughout
    f8 = torch.empty(rows, kp, dtype=dt, device=dev)
    data = torch.empty(m, k, dtype=dt, device=dev) if want_data else None
    dq = torch.empty(m, k, dtype=torch.float32, device=dev) if want_dq else None
    if want_dq:
        lut, i32 = _fp8_to_fp32_table(fmt, dev), torch.empty(rows * kp, dtype=torch.int32, device=dev)
    grid_only = want_dq and not want_data  # no FP8 codes wanted: round on the FP8 grid in FP32
    if granularity == "tensorwise":
        amax_all = amax_groups(x2, None).to(torch.float32)
        scale_all = scale_from_amax(amax_all, fp8_max, pow2)
    else:
        srows = -(-m // GROUP) if granularity == "block128" else m
        amax_all = torch.empty(srows, g, dtype=torch.float32, device=dev)
        scale_all = torch.empty(srows, g, dtype=torch.float32, device=dev)
    direct = x2.dtype == torch.float32 and k == kp  # divide straight from x into the buffer (no copy-in pass)
    for r0 in range(0, m, rows):
        n = min(rows, m - r0)
        if granularity == "block128":
            nb = -(-n // GROUP)
            b = buf[: nb * GROUP]
            if n < nb * GROUP:
                b[n:].zero_()
                direct_here = False
            else:
                direct_here = direct
        else:
            b, direct_here = buf[:n], direct
        src = x2[r0: r0 + n] if direct_here else b
        if not direct_here:
            b[:n, :k].copy_(x2[r0: r0 + n])
        if granularity == "tensorwise":
            v, sv, s = b, src, scale_all
        elif granularity == "rowwise":
            v, sv = b, src
            amax = amax_groups(src, -1).unsqueeze(-1)
            s = scale_from_amax(amax, fp8_max, pow2)
            amax_all[r0: r0 + n] = amax
            scale_all[r0: r0 + n] = s
        elif granularity in GROUP_SIZES:
            v, sv = b.view(n, g, width), src.view(n, g, width)
            amax = amax_groups(sv, -1)
            s = scale_from_amax(amax, fp8_max, pow2)
            amax_all[r0: r0 + n] = amax
            scale_all[r0: r0 + n] = s
            s = s.unsqueeze(-1)
        else:
            v, sv = b.view(nb, GROUP, g, GROUP), src.view(nb, GROUP, g, GROUP)
            amax = amax_groups(sv, (-3, -1))
            s = scale_from_amax(amax, fp8_max, pow2)
            sb = r0 // GROUP
            amax_all[sb: sb + nb] = amax
            scale_all[sb: sb + nb] = s
            s = s.unsqueeze(-1).unsqueeze(-3)
        if direct_here:
            torch.div(sv, s, out=v)
        else:
            v.div_(s)
        b.clamp_(-fp8_max, fp8_max)
        exact_rows = b.shape[0] == n and k == kp
        if grid_only:
            _round_to_fp8_grid_(b, i32[: b.numel()].view(b.shape), fmt)
            if exact_rows:
                torch.mul(v, s, out=dq[r0: r0 + n].view(v.shape))
            else:
                v.mul_(s)
                dq[r0: r0 + n].copy_(b[:n, :k])
            continue
        if data is not None and exact_rows:  # cast straight into the output
            f = data[r0: r0 + n]
            f.copy_(b)
        else:
            f = f8[: b.shape[0]]
            f.copy_(b)
            if data is not None:
                data[r0: r0 + n].copy_(f[:n, :k])
        if dq is not None:
            idx = i32[: f.numel()]
            idx.copy_(f.view(torch.uint8).reshape(-1))
            if exact_rows:
                d = dq[r0: r0 + n]
                torch.index_select(lut, 0, idx, out=d.view(-1))
                d.view(v.shape).mul_(s)
            else:
                torch.index_select(lut, 0, idx, out=b.view(-1))
                v.mul_(s)
                dq[r0: r0 + n].copy_(b[:n, :k])
    if not math.isfinite(float(amax_all.max())):  # amax >= 0; nan propagates through max
        raise NonFiniteInput(NON_FINITE)
    return data, scale_all, dq


def _columns(x: torch.Tensor, granularity: str, fmt: str, pow2: bool) -> torch.Tensor:
    t, k = x.shape
    fp8_max, dev = FP8_MAX[fmt], x.device
    if granularity == "rowwise":
        rows = min(t, max(1, _CHUNK_BYTES // (k * 4)))
        amax_all = amax_groups(x, 0).to(torch.float32)  # [K]: max(amax, -amin) of each column, exact
        scale_all = scale_from_amax(amax_all, fp8_max, pow2)
    else:
        gs = GROUP_SIZES[granularity]
        rows = min(-(-t // gs) * gs, max(gs, _CHUNK_BYTES // (k * 4) // gs * gs))
        amax_all = torch.empty(-(-t // gs), k, dtype=torch.float32, device=dev)
    buf = torch.zeros(rows, k, dtype=torch.float32, device=dev)
    i32 = torch.empty(rows * k, dtype=torch.int32, device=dev)
    dq = torch.empty(t, k, dtype=torch.float32, device=dev)
    for r0 in range(0, t, rows):
        n = min(rows, t - r0)
        if granularity == "rowwise":
            b, v, s = buf[:n], buf[:n], scale_all
        else:
            nb = -(-n // gs)
            b = buf[: nb * gs]
            if n < nb * gs:
                b[n:].zero_()
            v = b.view(nb, gs, k)
        b[:n].copy_(x[r0: r0 + n])
        if granularity in GROUP_SIZES:
            amax = amax_groups(v, 1)
            amax_all[r0 // gs: r0 // gs + nb] = amax
            s = scale_from_amax(amax, fp8_max, pow2).unsqueeze(1)
        v.div_(s)
        b.clamp_(-fp8_max, fp8_max)
        _round_to_fp8_grid_(b, i32[: b.numel()].view(b.shape), fmt)
        if b.shape[0] == n:
            torch.mul(v, s, out=dq[r0: r0 + n].view(v.shape))
        else:
            v.mul_(s)
            dq[r0: r0 + n].copy_(b[:n])
    if not math.isfinite(float(amax_all.max())):  # amax >= 0; nan propagates through max
        raise NonFiniteInput(NON_FINITE)
    return dq
