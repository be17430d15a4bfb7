"""fp8core.mx: MXFP8 codes and E8M0 scale bytes bit for bit torchao's ``to_mx`` (the reference), both scale rules
and both element formats, on random, subnormal, zero, saturating and extreme-exponent blocks; non-finite input
raises (the project's rule, where torchao writes a NaN scale)."""
import pytest
import torch

from fp8core.mx import mx_dequantize, mx_quantize
from fp8core.quant import NonFiniteInput

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)  # every block its binade
    blocks = torch.randn(16, 32 * 8, generator=g)
    blocks[0] = 0.0  # an all-zero row
    blocks[1, :32] = 1e-41  # subnormal FP32 block
    blocks[1, 32:64] = torch.linspace(-3e-39, 3e-39, 32)
    blocks[2, :32] = 3.0e38  # near FP32's largest
    blocks[2, 32:64] = torch.linspace(-1.7e38, 1.7e38, 32)
    for i, top in enumerate([448.0, 460.0, 479.9, 480.0, 500.0, 511.9, 512.0, 57344.0, 61440.0, 1.0, 0.875]):
        blocks[3 + i, :32] = torch.linspace(-top, top, 32)  # around E4M3 / E5M2 saturation and power-of-two edges
    return {"spread": spread, "edges": blocks, "bf16": (torch.randn(8, 128, generator=g) * 3).to(torch.bfloat16)}


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", ["spread", "edges", "bf16"])
def test_codes_and_scales_are_torchaos(rule, fmt, case):
    x = _cases()[case]
    ours = mx_quantize(x, fmt=fmt, rule=rule)
    scale, data = mx_tensor.to_mx(x.contiguous(), DTYPES[fmt], 32, MODES[rule])
    assert torch.equal(ours.scale, scale.view(torch.uint8).reshape(ours.scale.shape))
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8).reshape(ours.data.shape))


def test_rceil_never_saturates_and_floor_may():
    x = torch.linspace(-480.0, 480.0, 32).reshape(1, 32)  # amax 480 = 1.875 x 2**8
    floor, rceil = mx_quantize(x, rule="floor"), mx_quantize(x, rule="rceil")
    assert floor.dequantize().abs().max() == 448.0  # saturated at E4M3's largest
    assert rceil.dequantize().abs().max() == 480.0  # scale 2**1: 240 is an E4M3 value
    assert (int(floor.scale), int(rceil.scale)) == (127, 128)


def test_dequantize_is_code_times_the_power_of_two():
    x = torch.randn(4, 64) * 10
    q = mx_quantize(x)
    manual = q.data.float().reshape(4, 2, 32) * torch.pow(2.0, q.scale.float() - 127).unsqueeze(-1)
    assert torch.equal(mx_dequantize(q), manual.reshape(4, 64))
    assert (mx_dequantize(q) - x).abs().max() <= x.abs().max() * 2**-3  # E4M3: 3 mantissa bits


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(bad):
    x = torch.ones(2, 64)
    x[1, 40] = bad
    with pytest.raises(NonFiniteInput):
        mx_quantize(x)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="multiple of the block, 32"):
        mx_quantize(torch.ones(2, 48))
    with pytest.raises(ValueError, match="rule='round'"):
        mx_quantize(torch.ones(2, 32), rule="round")
    with pytest.raises(ValueError, match="fmt='e3m4'"):
        mx_quantize(torch.ones(2, 32), fmt="e3m4")


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 16), (1, 1), (130, 9), (300, 33)])
def test_swizzle_is_torchaos_to_blocked(rows, cols):
    from torchao.prototype.mx_formats.utils import to_blocked

    from fp8core.mx import swizzle_scales

    s = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows + cols))
    assert torch.equal(swizzle_scales(s), to_blocked(s))


@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (1, 64, 32), (130, 96, 200)])
def test_mx_gemm_is_one_scaled_mm_call_on_the_meta_device(m, k, n, monkeypatch):
    """The call form torch's meta kernel accepts (1x32 block scaling, swizzled E8M0 scales), once per GEMM; nothing
    is read back to the host there."""
    import torch.nn.functional as F

    from fp8core.mx import MXTensor, mx_mm

    calls = []
    real = F.scaled_mm
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    a = MXTensor(torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta"),
                 torch.empty(m, k // 32, dtype=torch.uint8, device="meta"))
    b = MXTensor(torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"),
                 torch.empty(n, k // 32, dtype=torch.uint8, device="meta"))
    out = mx_mm(a, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and len(calls) == 1


def test_on_a_cpu_the_mx_gemm_is_the_dequantized_product():
    """A CPU's torch rejects the MX call; the fallback's FP32 products of the exact dequantized operands."""
    from fp8core.mx import mx_mm

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 128, generator=g), torch.randn(16, 128, generator=g)
    qa, qb = mx_quantize(x), mx_quantize(w)
    out = mx_mm(qa, qb, out_dtype=torch.float32)
    assert torch.equal(out, mx_dequantize(qa) @ mx_dequantize(qb).t())
    assert (out - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


def test_mx_linear_quantizes_each_operand_along_what_its_gemm_contracts():
    """Forward, dgrad and wgrad equal the FP32 products of the operands MX-quantized along K, N and the tokens
    (padded to 32) respectively; and stay near the unquantized gradients."""
    from fp8core.mx import mx_linear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 64, generator=g, requires_grad=True)  # 21 tokens: the wgrad pads them to 32
    w = torch.randn(96, 64, generator=g, requires_grad=True)
    dy = torch.randn(3, 7, 96, generator=g)
    y = mx_linear(x, w, grad_fmt="e5m2")
    y.backward(dy)
    dq = lambda t, **kw: mx_dequantize(mx_quantize(t.contiguous(), **kw))  # noqa: E731
    x2, dy2 = x.detach().reshape(21, 64), dy.reshape(21, 96)
    pad = lambda t: torch.nn.functional.pad(t, (0, 11))  # noqa: E731
    assert torch.equal(y.detach().reshape(21, 96), dq(x2) @ dq(w.detach()).t())
    assert torch.equal(x.grad.reshape(21, 64), dq(dy2, fmt="e5m2") @ dq(w.detach().t()).t())
    assert torch.equal(w.grad, dq(pad(dy2.t()), fmt="e5m2") @ dq(pad(x2.t())).t())
    exact_dw = dy2.t() @ x2
    assert (w.grad - exact_dw).norm() < 0.15 * exact_dw.norm()


def test_mx_linear_on_the_meta_device_is_three_mx_gemms(monkeypatch):
    import torch.nn.functional as F

    from fp8core.mx import mx_linear

    calls = []
    real = F.scaled_mm
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    x = torch.empty(40, 128, device="meta", requires_grad=True)
    w = torch.empty(64, 128, device="meta", requires_grad=True)
    mx_linear(x, w).sum().backward()
    assert len(calls) == 3 and x.grad.shape == x.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group32_with_pow2_scales_is_mx_round_up(dtype):
    """The mxfp8 recipe's quantizer (fp8core.quant, granularity group32, pow2) against MX's round-up rule: the same
    codes everywhere and the same scales (2**(byte - 127)) on every group whose amax is in the normal range
    (>= 448 x 2**-126); an all-zero group gets the quantizer's floor 2**-126 where MX writes byte 0 (2**-127) --
    zero codes either way."""
    from fp8core.quant import quantize

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 256)  # every row spans 60 decades
    x[3, :32] = 0  # an all-zero group
    x[5, 32:64] = 448.0 * 2**-100  # tiny but normal
    x = x.to(dtype)
    q, m = quantize(x, "group32", pow2=True), mx_quantize(x, rule="rceil")
    assert torch.equal(q.data.view(torch.uint8), m.data.view(torch.uint8))
    mx_scale = torch.ldexp(torch.ones(m.scale.shape), m.scale.to(torch.int32) - 127)
    zero = x.float().reshape(64, 8, 32).abs().amax(-1) == 0
    assert int(zero.sum()) == 1
    assert torch.equal(q.scale[~zero], mx_scale[~zero])
    assert q.scale[zero].item() == 2.0**-126 and m.scale[zero].item() == 0
