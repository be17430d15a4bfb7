"""The scaled_mm backend (fp8core/scaled_mm.py) without a GPU: the one-call blockwise GEMM's arguments in the layouts
torch's meta kernel accepts and with the meaning the code gives them (a pure-torch twin of the call reads the scales
at the positions torch documents and must give the emulation's product), a whole FP8Linear forward + backward on the
meta device -- where no value can be read back to the host -- with one scaled-mm call per GEMM, E5M2 kept off the
blockwise call, the CPU's rejection of blockwise scaling taken as "unsupported" (so on a CPU only the fallback runs),
and out of memory propagating instead of selecting a fallback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8core import scaled_mm as smm
from fp8core.linear import FP8Linear, FP8LinearConfig, fp8_mm
from fp8core.quant import GROUP, QuantizedTensor, dequantize, quantize, quantize_columns

HAS_BLOCKWISE = smm.blockwise_in_torch()
needs_blockwise = pytest.mark.skipif(not HAS_BLOCKWISE, reason="this torch has no torch.nn.functional.scaled_mm")


def _twin(mat_a, scale_a, mat_b, scale_b, block_b: bool) -> torch.Tensor:
    """What F.scaled_mm(mat_a, mat_b.t(), scale_a, 1x128, scale_b, 128x128 | 1x128) computes, by the scale layouts
    torch documents (its meta kernel): scale_a[m, kb]; 128x128: scale_b[kb, n // 128]; 1x128: scale_b[n, kb]."""
    a, b = mat_a.float(), mat_b.float()
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    for c in range(a.shape[1] // GROUP):
        cols = slice(c * GROUP, (c + 1) * GROUP)
        sb = scale_b[c, :].repeat_interleave(GROUP) if block_b else scale_b[:, c]
        out += (a[:, cols] * scale_a[:, c, None]).double() @ (b[:, cols] * sb[:, None]).double().t()
    return out


def _forms(m: int, k: int, n: int, seed: int):
    """The three GEMMs of a blockwise linear with x [m, k], W [n, k]: (name, a, b) with a @ b.T the product."""
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(m, n, generator=g)
    wq = quantize(w, "block128")
    return [("fprop", quantize(x, "group128"), wq),
            ("dgrad", quantize(dy, "group128"), wq.t()),
            ("wgrad", quantize_columns(dy, "group128"), quantize_columns(x, "group128"))]


SHAPES = [(256, 512, 384), (1, 520, 300), (7, 384, 130), (300, 130, 17)]


@needs_blockwise
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_blockwise_arguments_mean_what_the_code_says_and_torch_accepts_them(m, k, n):
    for name, a, b in _forms(m, k, n, seed=m + k + n):
        assert smm.blockwise_form(a, b), name
        mat_a, scale_a, mat_b, scale_b, n_out = smm.blockwise_args(a, b)
        block_b = b.granularity == "block128"
        want = dequantize(a).double() @ dequantize(b).double().t()
        got = _twin(mat_a, scale_a, mat_b, scale_b, block_b)[:, :n_out]
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max())), name
        meta = [t.to("meta") if t.dim() == 2 and t.stride(0) >= t.stride(1) else
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in
                (mat_a, scale_a, mat_b, scale_b)]
        rec_b = F.ScalingType.BlockWise128x128 if block_b else F.ScalingType.BlockWise1x128
        y = F.scaled_mm(meta[0], meta[2].t(), meta[1], F.ScalingType.BlockWise1x128, meta[3], rec_b,
                        output_dtype=torch.float32)  # torch's layout checks (shapes, strides, dtypes)
        assert tuple(y.shape) == (a.data.shape[0], mat_b.shape[0]) and y.dtype == torch.float32, name


def _counting(monkeypatch):
    calls = {"blockwise": 0, "_scaled_mm": 0}
    real_f, real_t = getattr(F, "scaled_mm", None), torch._scaled_mm

    def f(mat_a, mat_b, *args, **kw):
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn, "an E5M2 operand reached the blockwise call"
        calls["blockwise"] += 1
        return real_f(mat_a, mat_b, *args, **kw)

    def t(*args, **kw):
        calls["_scaled_mm"] += 1
        return real_t(*args, **kw)

    if real_f is not None:
        monkeypatch.setattr(F, "scaled_mm", f)
    monkeypatch.setattr(torch, "_scaled_mm", t)
    monkeypatch.setattr(smm, "_BLOCKWISE_UNSUPPORTED", {})
    return calls


@needs_blockwise
@pytest.mark.parametrize("recipe,fmt,want", [
    ("blockwise", "e4m3", {"blockwise": 3, "_scaled_mm": 0}),
    ("rowwise", "e4m3", {"blockwise": 0, "_scaled_mm": 3}),
    ("tensorwise", "e4m3", {"blockwise": 0, "_scaled_mm": 3}),
    ("blockwise", "hybrid", None),  # E5M2 gradients: dgrad and wgrad chunked, the forward one blockwise call
])
@pytest.mark.parametrize("m,k,n", [(64, 512, 384), (1, 520, 300)])
def test_fp8linear_forward_backward_on_the_meta_device_one_call_per_gemm(recipe, fmt, want, m, k, n, monkeypatch):
    """On the meta device nothing can be read back to the host: the forward and backward running there is the proof
    that neither the quantizer nor the GEMM synchronizes; the counts say one scaled-mm call per GEMM."""
    calls = _counting(monkeypatch)
    lin = FP8Linear(k, n, bias=True, device="meta", config=FP8LinearConfig(recipe=recipe, fmt=fmt, backend="scaled_mm"))
    x = torch.empty(m, k, device="meta", requires_grad=True)
    y = lin(x)
    y.backward(torch.empty(m, n, device="meta"))
    assert y.shape == (m, n) and x.grad.shape == (m, k) and lin.weight.grad.shape == (n, k)
    assert lin.bias.grad.shape == (n,)
    if want is not None:
        assert calls == want
    else:
        assert calls["blockwise"] == 1 and calls["_scaled_mm"] == -(-n // GROUP) + -(-m // GROUP)


@needs_blockwise
def test_on_a_cpu_the_blockwise_call_is_unsupported_and_the_chunked_path_runs(monkeypatch):
    """A CPU's torch rejects blockwise scaling ("Invalid scaling configuration"): the first blockwise GEMM marks the
    CPU unsupported and runs the chunked path, which agrees with the emulation; so on a CPU the one-call path itself
    is checked only through the meta device and the twin above."""
    monkeypatch.setattr(smm, "_BLOCKWISE_UNSUPPORTED", {})
    for name, a, b in _forms(7, 520, 300, seed=3):
        got = fp8_mm(a, b, backend="scaled_mm")
        want = dequantize(a) @ dequantize(b).t()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), name
    assert set(smm._BLOCKWISE_UNSUPPORTED) == {"cpu"}
    assert smm.paths("cpu")["blockwise_e4m3"].startswith("chunked") and "Invalid scaling" in smm.paths("cpu")[
        "blockwise_e4m3"]


def test_only_unsupported_errors_select_a_fallback(monkeypatch):
    """Out of memory (CUDA's error class, or a message saying so) and any other error propagate from both the
    blockwise and the row-scaled call, and mark nothing unsupported; "not supported" errors do select the fallback."""
    assert not smm.unsupported(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not smm.unsupported(RuntimeError("CUDA error: out of memory"))
    assert not smm.unsupported(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x128 and 256x8)"))
    assert smm.unsupported(ValueError("Invalid scaling configuration.\n- For TensorWise scaling, ..."))
    assert smm.unsupported(RuntimeError("Only row-wise scaling with bfloat16 output is supported"))
    assert smm.unsupported(NotImplementedError("blockwise scaling is not implemented for sm_89"))

    a, b = _forms(8, 256, 128, seed=4)[0][1:]
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def raise_oom(*args, **kw):
        raise oom

    monkeypatch.setattr(smm, "_BLOCKWISE_UNSUPPORTED", {})
    monkeypatch.setattr(smm, "_ROWSCALED_FP32_UNSUPPORTED", {})
    if HAS_BLOCKWISE:
        monkeypatch.setattr(F, "scaled_mm", raise_oom)
        with pytest.raises(torch.OutOfMemoryError):
            fp8_mm(a, b, backend="scaled_mm")
        assert smm._BLOCKWISE_UNSUPPORTED == {}
    rq, wq = quantize(torch.randn(8, 256), "rowwise"), quantize(torch.randn(128, 256), "rowwise")
    monkeypatch.setattr(torch, "_scaled_mm", raise_oom)
    with pytest.raises(torch.OutOfMemoryError):
        fp8_mm(rq, wq, backend="scaled_mm")
    assert smm._ROWSCALED_FP32_UNSUPPORTED == {}


def test_e5m2_is_not_a_blockwise_form():
    x, w = torch.randn(4, 256), torch.randn(128, 256)
    assert not smm.blockwise_form(quantize(x, "group128", fmt="e5m2"), quantize(w, "block128"))
    assert not smm.blockwise_form(quantize(x, "rowwise"), quantize(w, "rowwise"))
    assert smm.blockwise_form(quantize(x, "group128"), QuantizedTensor(*_block(w)))


def _block(w):
    q = quantize(w, "block128")
    return q.data, q.scale, q.granularity, q.fmt


@needs_blockwise
@pytest.mark.parametrize("m,k,n", [(64, 512, 384), (1, 520, 300)])
def test_mxfp8_linear_on_the_meta_device_is_three_mx_calls(m, k, n, monkeypatch):
    """The mxfp8 recipe on scaled_mm: forward, dgrad and wgrad are one torch MX GEMM each (1x32 block scaling on both
    operands, swizzled E8M0 scales), on the meta device -- so nothing is read back to the host; K not a multiple of
    32 and one token included."""
    seen = []
    real = F.scaled_mm

    def record(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kw):
        seen.append((recipe_a, recipe_b, scale_a.dtype, scale_b.dtype, kw.get("swizzle_a"), kw.get("swizzle_b")))
        return real(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kw)

    monkeypatch.setattr(F, "scaled_mm", record)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: pytest.fail("a row / tensor scaled call ran"))
    cfg = FP8LinearConfig(recipe="mxfp8", pow2_weight=True, pow2_activation=True, backend="scaled_mm")
    lin = FP8Linear(k, n, bias=True, device="meta", config=cfg)
    x = torch.empty(m, k, device="meta", requires_grad=True)
    y = lin(x)
    y.backward(torch.empty(m, n, device="meta"))
    assert y.shape == (m, n) and x.grad.shape == (m, k) and lin.weight.grad.shape == (n, k)
    mx, e8m0, swz = F.ScalingType.BlockWise1x32, torch.float8_e8m0fnu, F.SwizzleType.SWIZZLE_32_4_4
    assert seen == [(mx, mx, e8m0, e8m0, swz, swz)] * 3
