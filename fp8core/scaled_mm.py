"""The FP8 GEMM on devices with FP8 matrix units: torch's scaled_mm (CUDA capability >= 8.9; on a CPU, torch's
reference / oneDNN kernel), the ``scaled_mm`` backend of fp8core.linear. One call per GEMM:

* blockwise E4M3 (the forward and dgrad: 1x128 activations x 128x128 weight blocks; the wgrad: 1x128 x 1x128 along
  the tokens): ``torch.nn.functional.scaled_mm`` with DeepSeek-style block scaling (cuBLASLt on SM90, FP32 output),
  its scales laid out as torch requires (:func:`blockwise_args`);
* rowwise / tensorwise: ``torch._scaled_mm`` with row / tensor scales.
* (1x32 groups with power-of-two scales, the mxfp8 recipe, go to torch's MX GEMM instead: fp8core.mx.mx_mm, called
  by fp8core.linear.fp8_mm.)

Blockwise with an E5M2 operand (the "hybrid" gradients: cuBLASLt's block-scaled kernels take E4M3 only), and any
device whose torch rejects the blockwise call as unsupported (a CPU does: "Invalid scaling configuration"; a torch
without ``F.scaled_mm``), run one ``torch._scaled_mm`` per 128-wide K chunk with FP32 output, the chunks added in
FP32. Only an "unsupported" error selects a fallback (remembered per device type); anything else -- out of memory
above all -- propagates.

No function here reads a device value back to the host: the whole GEMM runs on the meta device (tested there, with
the number of calls counted)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

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


# device type -> why: the calls torch rejected there as unsupported (the fallback then runs; see paths())
_ROWSCALED_FP32_UNSUPPORTED: dict[str, str] = {}  # row scales with FP32 output
_BLOCKWISE_UNSUPPORTED: dict[str, str] = {}  # the one-call blockwise GEMM
_BLOCKWISE_RAN: set[str] = set()  # device types where the one-call blockwise GEMM ran


def _scaled_mm_rows(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """FP32 ``(a8 * sa[:, None]) @ (b8 * sb[:, None]).T`` for FP8 a8 [M, k], b8 [N, k] with k % 16 == 0."""
    dev = a8.device.type
    if dev not in _ROWSCALED_FP32_UNSUPPORTED:
        try:
            # fresh standard strides: .contiguous() keeps odd strides on size-1 dims, which _scaled_mm rejects
            sa_c = sa.reshape(-1).clone(memory_format=torch.contiguous_format).reshape(-1, 1)
            sb_c = sb.reshape(-1).clone(memory_format=torch.contiguous_format).reshape(1, -1)
            return _scaled_mm(a8, b8.t(), scale_a=sa_c, scale_b=sb_c, out_dtype=torch.float32)
        except (RuntimeError, ValueError, NotImplementedError) as e:  # e.g. row-scaled kernels that emit BF16 only
            if not unsupported(e):
                raise
            _ROWSCALED_FP32_UNSUPPORTED[dev] = str(e).splitlines()[0][:200]  # then scale in FP32 ourselves
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


# "supported": "not supported", "unsupported", "only bf16 ... output types are supported for row-wise scaling", ...;
# "does not support": "CPU does not support swizzle" (an MX GEMM's scales)
_UNSUPPORTED_HINTS = ("supported", "does not support", "invalid scaling configuration", "not implemented",
                      "no kernel", "could not create a primitive")


def unsupported(e: BaseException) -> bool:
    """Whether ``e`` from a scaled_mm call says the call form is not supported here (so a fallback may run), as
    opposed to a failure of this call: out of memory (CUDA's OutOfMemoryError, or a message saying so) and every
    other error are not."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    if isinstance(e, NotImplementedError):
        return True
    msg = str(e).lower()
    return "out of memory" not in msg and any(h in msg for h in _UNSUPPORTED_HINTS)


def blockwise_in_torch() -> bool:
    """Whether this torch has the one-call blockwise GEMM (``torch.nn.functional.scaled_mm`` with ScalingType)."""
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


_BLOCKWISE_FORMS = {("group128", "block128"), ("group128", "group128")}


def blockwise_form(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether ``a @ b.T`` is a one-call blockwise GEMM: E4M3 both, 1x128 x 128x128 or 1x128 x 1x128 along K."""
    return a.fmt == b.fmt == "e4m3" and (a.granularity, b.granularity) in _BLOCKWISE_FORMS


def blockwise_args(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, ...]:
    """``(mat_a, scale_a, mat_b, scale_b, n)`` for one ``F.scaled_mm`` computing ``a @ b.T`` (``a [M, K]``
    group128; ``b [N, K]`` block128 or group128), in the layouts torch's scaled_mm checks (its meta kernel):

    * K zero-padded to whole 128-blocks (zero codes add nothing); N padded to 128 for a 128x128 ``b`` (its scale
      covers whole 128-row blocks), else to 16; padded rows carry zero codes and scale 1; the result is cropped to N;
    * ``mat_a`` = a's codes ``[M, Kp]`` row-major; ``scale_a`` ``[M, Kp/128]`` with strides ``(1, M)`` (built with
      ``empty_strided``: ``.t().contiguous().t()`` of a 1-row tensor keeps a stride torch rejects);
    * ``mat_b`` = b's codes ``[Np, Kp]`` row-major, passed transposed (``[Kp, Np]``, column-major);
    * 128x128 ``b``: ``scale_b`` ``[L4, Np/128]`` with strides ``(1, L4)``, L4 = Kp/128 rounded up to 4 -- the
      transpose of b's block scales ``[Np/128, L4]`` row-major, K blocks padded to L4 with 1 (the forward weight's
      scales as they are; the dgrad's transposed weight's re-laid out by the copy);
    * 1x128 ``b``: ``scale_b`` ``[Np, Kp/128]`` with strides ``(1, Np)``.
    The tests check what these mean, not only that torch accepts them: a pure-torch twin of the call reads the scales
    at these positions and must give the emulation's product."""
    m, k = a.data.shape
    n = b.data.shape[0]
    dev = a.data.device
    kb = -(-k // GROUP)
    kp = kb * GROUP
    block_b = b.granularity == "block128"
    n_p = -(-n // GROUP) * GROUP if block_b else -(-n // 16) * 16
    mat_a, mat_b = _pad_u8(a.data, m, kp), _pad_u8(b.data, n_p, kp)
    scale_a = torch.empty_strided((m, kb), (1, m), dtype=torch.float32, device=dev)
    scale_a.copy_(a.scale.to(torch.float32))
    if block_b:
        l4 = -(-kb // 4) * 4
        blocks = torch.ones(n_p // GROUP, l4, dtype=torch.float32, device=dev)
        blocks[: b.scale.shape[0], :kb] = b.scale
        scale_b = blocks.t()
    else:
        scale_b = torch.empty_strided((n_p, kb), (1, n_p), dtype=torch.float32, device=dev)
        scale_b.fill_(1.0)
        scale_b[:n].copy_(b.scale.to(torch.float32))
    return mat_a, scale_a, mat_b, scale_b, n


def _blockwise(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor | None:
    """FP32 ``a @ b.T`` in one blockwise ``F.scaled_mm`` call, or None where this device's torch does not support
    it (then remembered: later calls go straight to the chunked path)."""
    dev = a.data.device.type
    if dev in _BLOCKWISE_UNSUPPORTED or not blockwise_in_torch():
        return None
    mat_a, scale_a, mat_b, scale_b, n = blockwise_args(a, b)
    rec_b = F.ScalingType.BlockWise128x128 if b.granularity == "block128" else F.ScalingType.BlockWise1x128
    try:
        out = F.scaled_mm(mat_a, mat_b.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, rec_b,
                          output_dtype=torch.float32)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        if not unsupported(e):
            raise
        _BLOCKWISE_UNSUPPORTED[dev] = str(e).splitlines()[0][:200]
        return None
    _BLOCKWISE_RAN.add(dev)
    return out[:, :n]


def paths(device: torch.device | str) -> dict[str, str]:
    """Which path the GEMMs took on ``device`` in this process (bench/gpu_check.py records it): blockwise E4M3 as one
    call or chunked (and why), rowwise with FP32 output or scaled after the GEMM (and why)."""
    dev = torch.device(device).type
    if not blockwise_in_torch():
        blockwise = "chunked: this torch has no torch.nn.functional.scaled_mm"
    elif dev in _BLOCKWISE_UNSUPPORTED:
        blockwise = f"chunked (one call per 128-wide K chunk): {_BLOCKWISE_UNSUPPORTED[dev]}"
    elif dev in _BLOCKWISE_RAN:
        blockwise = "one call of torch.nn.functional.scaled_mm (blockwise scaling)"
    else:
        blockwise = "not run yet"
    rowwise = (f"scaled in FP32 after the GEMM: {_ROWSCALED_FP32_UNSUPPORTED[dev]}" if dev in _ROWSCALED_FP32_UNSUPPORTED
               else "row scales in the call, FP32 output")
    return {"blockwise_e4m3": blockwise, "rowwise": rowwise}


def _fp8_mm_scaled(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    if blockwise_form(a, b):
        out = _blockwise(a, b)
        if out is not None:
            return out
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
