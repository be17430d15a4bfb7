"""The FP8 GEMM on devices with FP8 matrix units: ``torch._scaled_mm`` (CUDA capability >= 8.9; on a CPU, torch's
reference / oneDNN kernel), the ``scaled_mm`` backend of fp8core.linear. Blockwise runs one call per 128-wide K
chunk with FP32 output, the chunks added in FP32; rowwise and tensorwise one call."""
from __future__ import annotations

import contextlib

import torch

from fp8core.quant import GROUP, QuantizedTensor


def _chunk_row_scales(q: QuantizedTensor, chunk: int, rows: int) -> torch.Tensor:
    """Per-row FP32 scales of ``q`` for the K-chunk ``chunk`` (128 wide, or all of K for one-chunk GEMMs)."""
    if q.granularity == "tensorwise":
        return q.scale.reshape(1).expand(rows)
    if q.granularity == "rowwise":
        return q.scale[:, 0]
    if q.granularity == "group128":
        return q.scale[:, chunk]
    return q.scale[:, chunk].repeat_interleave(GROUP)[:rows]


def _pad_u8(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad 2-D FP8 data to [rows, cols] (byte 0 is +0.0 in both formats)."""
    r, c = data.shape
    if (r, c) == (rows, cols):
        return data.contiguous()
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=data.device)
    out[:r, :c] = data.view(torch.uint8) if data.is_contiguous() else data.contiguous().view(torch.uint8)
    return out.view(data.dtype)


_ROWSCALED_FP32_UNSUPPORTED: set[str] = set()  # device types whose _scaled_mm rejects row scales with FP32 output


def _scaled_mm_rows(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """FP32 ``(a8 * sa[:, None]) @ (b8 * sb[:, None]).T`` for FP8 a8 [M, k], b8 [N, k] with k % 16 == 0."""
    dev = a8.device.type
    if dev not in _ROWSCALED_FP32_UNSUPPORTED:
        try:
            # fresh standard strides: .contiguous() keeps odd strides on size-1 dims, which _scaled_mm rejects
            sa_c = sa.reshape(-1).clone(memory_format=torch.contiguous_format).reshape(-1, 1)
            sb_c = sb.reshape(-1).clone(memory_format=torch.contiguous_format).reshape(1, -1)
            return _scaled_mm(a8, b8.t(), scale_a=sa_c, scale_b=sb_c, out_dtype=torch.float32)
        except RuntimeError:  # e.g. CUDA row-scaled kernels that only emit BF16: scale in FP32 ourselves
            _ROWSCALED_FP32_UNSUPPORTED.add(dev)
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    raw = _scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return raw * sa.reshape(-1, 1) * sb.reshape(1, -1)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, **kw) -> torch.Tensor:
    """``torch._scaled_mm``. On a CPU whose kind is capped (FP8GRPO_CPU_CAP, fp8core.cpu): torch picks oneDNN's FP8
    kernel from the hardware (AMX), but the cap limits oneDNN to the lower ISA, which has none ("could not create a
    primitive descriptor"), so the call runs with oneDNN off -- torch's reference path, what a CPU of the capped kind
    runs anyway."""
    ctx = contextlib.nullcontext()
    if a.device.type == "cpu":
        from fp8core.cpu import cpu_caps

        if cpu_caps().capped:
            ctx = torch.backends.mkldnn.flags(enabled=False)
    with ctx:
        return torch._scaled_mm(a, b, **kw)


def _fp8_mm_scaled(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    m, k = a.data.shape
    n = b.data.shape[0]
    if a.granularity == "tensorwise" and b.granularity == "tensorwise":
        kp, n_p = -(-k // 16) * 16, -(-n // 16) * 16
        out = _scaled_mm(_pad_u8(a.data, m, kp), _pad_u8(b.data, n_p, kp).t(), scale_a=a.scale,
                               scale_b=b.scale, out_dtype=torch.float32)
        return out[:, :n]
    chunked = any(q.granularity in ("group128", "block128") for q in (a, b))
    width = GROUP if chunked else -(-k // 16) * 16
    kp, n_p = -(-k // width) * width, -(-n // 16) * 16
    a8, b8 = _pad_u8(a.data, m, kp), _pad_u8(b.data, n_p, kp)
    out = torch.zeros(m, n_p, dtype=torch.float32, device=a.data.device)
    for c in range(kp // width):
        sa = _chunk_row_scales(a, c, m)
        sb = torch.ones(n_p, dtype=torch.float32, device=out.device)
        sb[:n] = _chunk_row_scales(b, c, n)
        cols = slice(c * width, (c + 1) * width)
        out += _scaled_mm_rows(a8[:, cols].contiguous(), b8[:, cols].contiguous(), sa, sb)
    return out[:, :n]
