"""The CPU FP8 GEMM (fp8core.gemm, fp8core/csrc/gemm.cpp): exact products, FP32 sums within the float64
reference's bound, a row's output independent of its batch and of the thread count, the fake kernel, and the FP32
path under the AVX2 cap. On an x86-64 Linux machine with a C++ compiler the op must build: no skip there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8core import gemm, kernels
from fp8core.cpu import cpu_caps
from fp8core.linear import fp8_linear, fp8_mm
from fp8core.quant import FP8_DTYPES, dequantize, quantize

ROOT = Path(__file__).resolve().parents[2]
U = 2.0 ** -24  # FP32 unit roundoff
BUILDS_HERE = kernels.no_kernel_reason() is None  # where a failed build is a failure, not a skip


def test_the_op_builds_where_it_should():
    """A CPU kind with AVX2 and a compiler must have the op: a failed build is a failure, not a fallback."""
    if not BUILDS_HERE:
        pytest.skip(f"no kernel for this machine: {kernels.no_kernel_reason()}")
    assert gemm.available(), gemm.path()
    expected = "avx512_bf16" if cpu_caps().kind in ("avx512_bf16", "amx") else "fp32"
    assert gemm.path().startswith(expected), gemm.path()


def _reference(a8, sa, b8, sb, block):
    """float64 ``sum_kb (sa * sb) * (A_kb @ B_kb.T)`` and its error bound (recursive summation in FP32: each output
    is at most L + nkb + 2 FP32 roundings away, L the block length) from codes and per-row block scales."""
    a, b = a8.to(torch.float64), b8.to(torch.float64)
    k = a.shape[1]
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    mass = torch.zeros_like(out)
    nkb = sa.shape[1]
    for kb in range(nkb):
        cols = slice(kb * block, min(k, (kb + 1) * block))
        s = sa[:, kb:kb + 1].double() * sb[:, kb].double()[None]
        out += s * (a[:, cols] @ b[:, cols].T)
        mass += s.abs() * (a[:, cols].abs() @ b[:, cols].abs().T)
    steps = min(block, k) + nkb + 2
    return out, 1.01 * steps * U * mass


def _codes(shape, fmt, gen):
    """Random finite codes of ``fmt`` (every byte but NaN / inf)."""
    c = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    v = c.view(FP8_DTYPES[fmt]).to(torch.float32)
    return torch.where(torch.isfinite(v), c, torch.zeros_like(c)).view(FP8_DTYPES[fmt])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_code_passes_through_the_bf16_units_exactly(fmt):
    """Each of the 256 codes times the code of 1.0 (scales 1) gives the code's own value: every E4M3 / E5M2 value is
    a normal BF16 number (E5M2's smallest subnormal is 2^-16), NaN / inf aside."""
    assert gemm.available(), gemm.path()
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(FP8_DTYPES[fmt]).to(torch.float32)
    finite = torch.isfinite(values)
    assert torch.equal(values[finite].to(torch.bfloat16).to(torch.float32), values[finite])
    a = torch.stack([codes[finite], torch.zeros_like(codes[finite])], 1)  # [n, 2]: the code, then a zero
    one = torch.tensor([[1.0, 0.0]]).to(FP8_DTYPES[fmt]).view(torch.uint8)
    y = gemm.fp8_gemm_rows(a, fmt, torch.ones(len(a), 1), one, fmt, torch.ones(1, 1), 2)
    assert torch.equal(y[:, 0], values[finite])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("strided", [False, True])
def test_every_code_in_long_runs_through_both_packers(fmt, strided):
    """The packers convert codes many at a time (32 per step on BF16 units, 8 on the FP32 path): a cyclic matrix
    holding every finite code in each row (row-major, or the transposed view the wgrad GEMM passes) times the
    identity gives every code's value back exactly, on the A side and on the B side; a row with a NaN code is NaN
    (that run takes the table) and the other rows stay exact."""
    assert gemm.available(), gemm.path()
    dt = FP8_DTYPES[fmt]
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(dt).to(torch.float32))]
    n = len(finite)
    idx = (torch.arange(n).unsqueeze(1) + torch.arange(n).unsqueeze(0)) % n
    cyclic = finite[idx]  # [n, n], every finite code in every row
    eye = torch.eye(n).to(dt).view(torch.uint8)
    want = cyclic.view(dt).to(torch.float32)
    ones = torch.ones(n, 1)

    def operand(x):
        return x.t().contiguous().t() if strided else x

    a_side = gemm.fp8_gemm_rows(operand(cyclic), fmt, ones, operand(eye), fmt, ones, n)
    b_side = gemm.fp8_gemm_rows(operand(eye), fmt, ones, operand(cyclic), fmt, ones, n)
    assert torch.equal(a_side, want) and torch.equal(b_side, want.t())
    with_nan = cyclic.clone()
    with_nan[0, 5] = 0x7F if fmt == "e4m3" else 0x7E
    y = gemm.fp8_gemm_rows(operand(with_nan), fmt, ones, operand(eye), fmt, ones, n)
    assert bool(y[0].isnan().all()) and torch.equal(y[1:], want[1:])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_transposed_view_packs_to_the_same_values(fmt):
    """A weight-side operand whose rows lie side by side in memory (the transposed view the wgrad and dgrad GEMMs
    pass, packed lane by lane in vector registers) packs to exactly the values and scales of the same codes laid
    out row-major (packed row by row): every byte value, NaN and infinity codes included, odd block lengths, a
    last tile short of lanes."""
    assert gemm.available(), gemm.path()
    gen = torch.Generator().manual_seed(9)
    for n, k, block in ((16, 1, 1), (48, 7, 7), (50, 300, 128), (33, 257, 128), (64, 129, 129), (17, 256, 128)):
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        rows = torch.rand(n, -(-k // block), generator=gen)
        view = codes.t().contiguous().t()  # the same codes, strides (1, n)
        assert view.stride(0) == 1 and torch.equal(view, codes)
        got = gemm.pack_weight(view, fmt, rows, block)
        want = gemm.pack_weight(codes, fmt, rows, block)
        same_bits = torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))  # NaN values too
        assert same_bits and torch.equal(got.scales, want.scales), (n, k, block)


CASES = [  # (a granularity, b granularity, M, N, K): the linear's GEMMs and odd sizes
    ("group128", "block128", 7, 300, 520),   # blockwise fprop, partial last block, N not a multiple of 16
    ("group128", "block128", 64, 256, 1024),
    ("group128", "group128", 130, 90, 384),  # blockwise wgrad (both along tokens)
    ("rowwise", "rowwise", 33, 70, 301),     # one block of all of K (odd: padded pair)
    ("tensorwise", "tensorwise", 5, 40, 256),
]


@pytest.mark.parametrize("ga,gb,m,n,k", CASES)
@pytest.mark.parametrize("fmt_b", ["e4m3", "e5m2"])
def test_matches_the_float64_reference_within_its_bound(ga, gb, m, n, k, fmt_b):
    gen = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k).roll(m)  # columns of very different sizes
    b = torch.randn(n, k, generator=gen)
    qa, qb = quantize(a, ga, fmt="e4m3"), quantize(b, gb, fmt=fmt_b)
    block = gemm.block_for(ga, gb, k)
    y = gemm.fp8_gemm(qa, qb)
    ref, bound = _reference(qa.data, gemm.row_scales(qa, block), qb.data, gemm.row_scales(qb, block), block)
    excess = ((y.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"an output is {excess:.3g} beyond the bound"
    # the dequantize -> FP32 GEMM emulation computes the same products, summed in another order
    emu = dequantize(qa) @ dequantize(qb).T
    assert torch.allclose(y, emu, rtol=1e-5, atol=1e-5 * emu.abs().max().item())


@pytest.mark.parametrize("ga,gb", [("group128", "block128"), ("rowwise", "rowwise"), ("tensorwise", "tensorwise")])
def test_a_rows_output_does_not_depend_on_its_batch_or_the_threads(ga, gb):
    """Row i computed alone, inside batches of 2 .. 97 rows, and with 1 or 2 threads: the same bits."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(97, 640, generator=gen), torch.randn(200, 640, generator=gen)
    qw = quantize(w, gb)
    block = gemm.block_for(ga, gb, 640)
    w_rows = gemm.row_scales(qw, block)
    full_q = quantize(x, ga)  # the activations' scales: per row (tensorwise: one for all; fixed here)

    def rows(lo, hi):
        sub = full_q.data[lo:hi]
        sa = gemm.row_scales(full_q, block)[lo:hi]
        return gemm.fp8_gemm_rows(sub, "e4m3", sa, qw.data, "e4m3", w_rows, block)

    everything = rows(0, 97)
    for size in (1, 2, 3, 6, 7, 16, 33, 64):
        for lo in (0, 97 - size):
            assert torch.equal(rows(lo, lo + size), everything[lo:lo + size]), (size, lo)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(rows(0, 97), everything)
    finally:
        torch.set_num_threads(threads)


def test_the_linear_row_alone_equals_the_row_in_a_batch():
    """Through fp8_linear as the trainer calls it (blockwise and rowwise: token-local activation scales)."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 256, generator=gen), torch.randn(384, 256, generator=gen)
    for recipe in ("blockwise", "rowwise"):
        full = fp8_linear(x, w, recipe=recipe, backend="cpu")
        for i in (0, 17, 39):
            assert torch.equal(fp8_linear(x[i:i + 1], w, recipe=recipe, backend="cpu")[0], full[i]), (recipe, i)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fwd_and_bwd_agree_with_the_emulation(recipe, fmt):
    """The three GEMMs on the CPU op against the dequantize -> FP32 emulation: the same operand codes and scales,
    the sums in another order (relative difference at FP32 rounding level)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, 300, generator=gen)
    w = torch.randn(260, 300, generator=gen) * 0.05
    bias = torch.randn(260, generator=gen)
    grads = {}
    for backend in ("cpu", "emulated"):
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, bias))
        y = fp8_linear(xx, ww, bb, recipe=recipe, fmt=fmt, backend=backend)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        grads[backend] = (y.detach(), xx.grad, ww.grad, bb.grad)
    for got, want in zip(grads["cpu"], grads["emulated"], strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_packed_weight_gives_the_same_bits():
    """The weight packed once (as the engine per refit and the trainer per update) and per call: the same output."""
    gen = torch.Generator().manual_seed(6)
    for ga, gb, k in (("group128", "block128", 300), ("rowwise", "rowwise", 77), ("tensorwise", "tensorwise", 256)):
        qa, qb = quantize(torch.randn(11, k, generator=gen), ga), quantize(torch.randn(35, k, generator=gen), gb)
        block = gemm.block_for(ga, gb, k)
        packed = gemm.pack_weight(qb.data, "e4m3", gemm.row_scales(qb, block), block)
        assert packed.nbytes() < 4.2 * qb.data.numel() + 64 * 4 * packed.scales.numel()
        assert torch.equal(gemm.fp8_gemm_packed(qa.data, "e4m3", gemm.row_scales(qa, block), packed),
                           gemm.fp8_gemm(qa, qb))
    with pytest.raises(ValueError, match="K = 77"):
        gemm.fp8_gemm_packed(qa.data, "e4m3", gemm.row_scales(qa, block), packed._replace(k=77))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantizing_inside_the_op_gives_quantizes_codes_and_the_same_bits(dtype, fmt, pow2):
    """The activations quantized inside the op, straight into its packed layout (the linear's forward and dgrad),
    against quantize() then the op on its codes: the same scales and the same output bits, for group128 (K blocks
    of 128, a partial last one) and rowwise (one block of all of K, odd), with rows of zeros, of tiny values
    (subnormal codes) and of very different sizes."""
    assert gemm.available(), gemm.path()
    gen = torch.Generator().manual_seed(10)
    for gran, gb, m, n, k in (("group128", "block128", 7, 300, 520), ("group128", "block128", 50, 64, 128),
                              ("group128", "block128", 1, 40, 1000), ("rowwise", "rowwise", 33, 70, 301)):
        x = (torch.randn(m, k, generator=gen) * torch.logspace(-6, 4, k).roll(m)).to(dtype)
        x[0] = 0.0
        if m > 3:
            x[2] = torch.randn(k, generator=gen).to(dtype) * 1e-30
        qb = quantize(torch.randn(n, k, generator=gen), gb)
        block = gemm.block_for(gran, gb, k)
        packed = gemm.pack_weight(qb.data, "e4m3", gemm.row_scales(qb, block), block)
        assert gemm.quantizes_into_pack(gran, packed)
        qa = quantize(x, gran, fmt=fmt, pow2=pow2)
        want = gemm.fp8_gemm_packed(qa.data, fmt, gemm.row_scales(qa, block), packed)
        y, scales, amax = torch.ops.fp8core.fp8_quant_gemm_packed(x, 0 if fmt == "e4m3" else 1, pow2, packed.values,
                                                                   packed.scales, n, block)
        assert torch.equal(scales, gemm.row_scales(qa, block)), (gran, k)
        assert torch.equal(y, want), (gran, m, k)
        assert float(amax) == float(x.abs().max())
        assert torch.equal(gemm.fp8_quant_gemm_packed(x, fmt, packed, pow2=pow2), want)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantizing_inside_the_op_passes_every_value_through(fmt):
    """Inside the op the quantized values go to the BF16 units without forming their codes: each row holding every
    finite value of the format (amax = the format's max, so the rowwise scale is 1 and quantization is exact) times
    the identity gives every value back."""
    assert gemm.available(), gemm.path()
    dt = FP8_DTYPES[fmt]
    values = torch.arange(256, dtype=torch.uint8).view(dt).to(torch.float32)
    finite = values[torch.isfinite(values)]
    n = len(finite)
    cyclic = finite[(torch.arange(n).unsqueeze(1) + torch.arange(n).unsqueeze(0)) % n]
    eye = torch.eye(n).to(torch.float8_e4m3fn).view(torch.uint8)
    packed = gemm.pack_weight(eye, "e4m3", torch.ones(n, 1), n)
    assert gemm.quantizes_into_pack("rowwise", packed)
    y = gemm.fp8_quant_gemm_packed(cyclic, fmt, packed)
    assert torch.equal(y, cyclic)


def test_quantizing_inside_the_op_rejects_non_finite_input_as_quantize_does():
    from fp8core.quant import NON_FINITE

    qb = quantize(torch.randn(32, 256), "block128")
    packed = gemm.pack_weight(qb.data, "e4m3", gemm.row_scales(qb, 128), 128)
    assert not gemm.quantizes_into_pack("tensorwise", packed)  # one scale for all of x: quantize() first
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5, 256)
        x[3, 200] = bad
        with pytest.raises(ValueError, match="non-finite") as got:
            gemm.fp8_quant_gemm_packed(x, "e4m3", packed)
        assert str(got.value) == NON_FINITE
    with pytest.raises(ValueError, match="K = 255"):
        gemm.fp8_quant_gemm_packed(torch.randn(5, 255), "e4m3", packed)


def test_stale_values_in_the_kept_activation_buffer_never_reach_a_padded_block():
    """The op keeps its packed-activation buffer between calls and does not clear it: a call whose K blocks are
    padded (odd K: rowwise, a partial group128 block; codes row-major and transposed, and quantized inside the op)
    right after a call that filled the buffer with NaN (codes 0x7F) still gives the product of its own operands
    (float64 reference): B's padding is zero, but a stale NaN times zero is NaN."""
    assert gemm.available(), gemm.path()
    gen = torch.Generator().manual_seed(12)
    nan_codes = torch.full((64, 1024), 0x7F, dtype=torch.uint8)  # E4M3 NaN in every position of the buffer
    wbig = quantize(torch.randn(48, 1024, generator=gen), "block128")

    def fill_with_nan():
        gemm.fp8_gemm_rows(nan_codes, "e4m3", torch.ones(64, 8), wbig.data, "e4m3", gemm.row_scales(wbig, 128), 128)

    for gran, gb, k in (("rowwise", "rowwise", 301), ("group128", "block128", 200)):
        x = torch.randn(64, k, generator=gen)
        qb = quantize(torch.randn(40, k, generator=gen), gb)
        block = gemm.block_for(gran, gb, k)
        packed = gemm.pack_weight(qb.data, "e4m3", gemm.row_scales(qb, block), block)
        qa = quantize(x, gran)
        want = dequantize(qa).double() @ dequantize(qb).double().t()
        for a_codes in (qa.data, qa.data.t().contiguous().t()):  # row-major, then a transposed view
            fill_with_nan()
            got = gemm.fp8_gemm_packed(a_codes, "e4m3", gemm.row_scales(qa, block), packed)
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), (gran, k)
        fill_with_nan()
        got = gemm.fp8_quant_gemm_packed(x, "e4m3", packed)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), (gran, k)


def test_mm_backend_cpu_is_the_op():
    gen = torch.Generator().manual_seed(4)
    qa, qb = quantize(torch.randn(9, 200, generator=gen), "group128"), quantize(torch.randn(30, 200), "block128")
    assert torch.equal(fp8_mm(qa, qb, backend="cpu"), gemm.fp8_gemm(qa, qb))


def test_the_fake_kernel_gives_the_shape_on_the_meta_device():
    assert gemm.available(), gemm.path()
    a = torch.empty(5, 256, dtype=torch.uint8, device="meta")
    b = torch.empty(48, 256, dtype=torch.uint8, device="meta")
    y = torch.ops.fp8core.fp8_gemm(a, 0, torch.empty(5, 2, device="meta"), b, 0, torch.empty(48, 2, device="meta"), 128)
    assert y.device.type == "meta" and y.shape == (5, 48) and y.dtype == torch.float32
    values, scales = torch.ops.fp8core.fp8_pack(b, 0, torch.empty(48, 2, device="meta"), 128)
    real = gemm.pack_weight(torch.zeros(48, 256, dtype=torch.uint8), "e4m3", torch.ones(48, 2), 128)
    assert (values.shape, values.dtype, scales.shape) == (real.values.shape, real.values.dtype, real.scales.shape)
    y = torch.ops.fp8core.fp8_gemm_packed(a, 0, torch.empty(5, 2, device="meta"), values, scales, 48, 128)
    assert y.device.type == "meta" and y.shape == (5, 48)
    x = torch.empty(5, 256, device="meta")
    y, sa, amax = torch.ops.fp8core.fp8_quant_gemm_packed(x, 0, False, values, scales, 48, 128)
    assert (y.shape, sa.shape, amax.shape) == ((5, 48), (5, 2), ()) and y.device.type == "meta"


_CAPPED = r"""
import json, sys, torch
from fp8core import gemm, kernels
from fp8core.cpu import cpu_caps
from fp8core.quant import quantize
sys.path.insert(0, sys.argv[1])
from test_gemm import _reference
gen = torch.Generator().manual_seed(5)
qa, qb = quantize(torch.randn(37, 520, generator=gen), "group128"), quantize(torch.randn(70, 520, generator=gen), "block128")
y = gemm.fp8_gemm(qa, qb)
ref, bound = _reference(qa.data, gemm.row_scales(qa, 128), qb.data, gemm.row_scales(qb, 128), 128)
alone = gemm.fp8_gemm_rows(qa.data[3:4], "e4m3", gemm.row_scales(qa, 128)[3:4], qb.data, "e4m3", gemm.row_scales(qb, 128), 128)
print(json.dumps({"kind": cpu_caps().kind, "path": gemm.path(), "within": bool(((y.double() - ref).abs() <= bound).all()),
                  "row_alone": bool(torch.equal(alone[0], y[3])), "out": y[:2, :4].tolist()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_the_fp32_path_under_a_cap(cap):
    """Under FP8GRPO_CPU_CAP (a kind without BF16 units) the op is built for that kind and takes the FP32 path: within
    the same bound, a row alone equals the row in its batch. (Native results of different kinds may differ in
    the last bits: the order inside a block is the kind's.)"""
    from fp8core.cpu import _rank

    if not BUILDS_HERE or _rank(cpu_caps().hardware_kind) < _rank(cap):
        pytest.skip(f"the hardware kind {cpu_caps().hardware_kind} is below the cap {cap}")
    env = {**os.environ, "FP8GRPO_CPU_CAP": cap}
    out = subprocess.run([sys.executable, "-c", _CAPPED, str(Path(__file__).parent)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kind"] == cap and r["path"].startswith("fp32"), r
    assert r["within"] and r["row_alone"], r
