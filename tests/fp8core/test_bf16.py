"""fp8core.bf16: emulated BF16 (BF16-rounded operands, FP32 accumulation, BF16-rounded results) against torch's
BF16 kernels and a float64 reference, gradients, the rounded-weight cache, mode resolution."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8core.bf16 import BF16Emulation, bf16_linear, resolve_bf16_mode, round_bf16


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of BF16 values at |t| (8 significant bits)."""
    e = torch.frexp(t.abs().clamp_min(2.0**-120))[1]
    return torch.ldexp(torch.ones_like(t), e - 8)


def test_round_bf16_is_torch_cast():
    x = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    assert torch.equal(round_bf16(x), x.to(torch.bfloat16).float())
    assert round_bf16(x.double()) is not None and round_bf16(x.double()).dtype == torch.float64


def test_linear_matches_float64_of_bf16_operands():
    """Each output = bf16 round of the exact dot product of the BF16-rounded operands (FP32 accumulation: within
    one BF16 ulp of it)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 300, generator=g), torch.randn(200, 300, generator=g), torch.randn(200, generator=g)
    y = bf16_linear(x, w, b)
    exact = round_bf16(x).double() @ round_bf16(w).double().t() + round_bf16(b).double()
    assert torch.equal(y, round_bf16(y))  # BF16-valued
    assert ((y.double() - exact).abs() <= _bf16_ulp(exact.float()).double()).all()


def test_mode_agrees_with_torch_bf16_autocast_on_a_linear_stack():
    """Same network, torch.autocast(bfloat16) vs BF16Emulation: outputs and gradients within BF16 rounding."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 64))
    x = torch.randn(32, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_nat = net(x)
    y_nat.float().square().mean().backward()
    g_nat = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with BF16Emulation():
        y_emu = net(x)
    assert y_emu.dtype == torch.float32 and torch.equal(y_emu, round_bf16(y_emu))
    y_emu.square().mean().backward()
    rel = (y_emu - y_nat.float()).abs().max() / y_nat.float().abs().max()
    assert rel < 2e-2
    for p, g in zip(net.parameters(), g_nat, strict=True):
        assert (p.grad - g).abs().max() / g.abs().max() < 5e-2
    # and it is not the FP32 result: BF16 rounding is visible
    assert not torch.equal(y_emu, net(x))


def test_gradients_are_bf16_gemms():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 40, generator=g, requires_grad=True)
    w = torch.randn(24, 40, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True)
    dy = torch.randn(16, 24, generator=g)
    bf16_linear(x, w, b).backward(dy)
    dy_r = round_bf16(dy).double()
    for got, exact in ((x.grad, dy_r @ round_bf16(w.detach()).double()),
                       (w.grad, dy_r.t() @ round_bf16(x.detach()).double()), (b.grad, dy_r.sum(0))):
        assert torch.equal(got, round_bf16(got))
        assert ((got.double() - exact).abs() <= _bf16_ulp(exact.float()).double()).all()


def test_matmul_and_sdpa_rounded():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, 8, generator=g)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    with BF16Emulation():
        mm = a @ b
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(mm, round_bf16(round_bf16(a) @ round_bf16(b)))
    ref = F.scaled_dot_product_attention(round_bf16(q), round_bf16(k), round_bf16(v), is_causal=True)
    assert torch.equal(att, round_bf16(ref))


def test_rounded_weight_cached_per_version():
    lin = nn.Linear(64, 32)
    mode = BF16Emulation()
    x = torch.randn(4, 64)
    with mode:
        lin(x)
    first = mode.weights.get(lin.weight)
    assert mode.weights.get(lin.weight) is first
    with torch.no_grad():
        lin.weight.add_(1.0)
    second = mode.weights.get(lin.weight)
    assert second is not first and torch.equal(second, round_bf16(lin.weight.detach()))
    with mode:
        y = lin(x)
    assert torch.equal(y, bf16_linear(x, lin.weight, lin.bias))


def test_resolve_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_bf16_mode("auto", device=cpu, native_bf16=True) == "native"
    assert resolve_bf16_mode("auto", device=cpu, native_bf16=False) == "emulated"
    assert resolve_bf16_mode("auto", device=cuda, native_bf16=False) == "native"
    assert resolve_bf16_mode("emulated", device=cpu, native_bf16=True) == "emulated"
    assert resolve_bf16_mode("native", device=cpu, native_bf16=False) == "native"
    with pytest.raises(ValueError, match="bf16_mode"):
        resolve_bf16_mode("fast", device=cpu, native_bf16=True)


def test_fp8_linear_is_untouched_by_the_mode():
    """FP8Linear inside BF16Emulation computes exactly its FP8 numerics (the mode must not re-round its GEMMs)."""
    from fp8core.linear import FP8Linear

    torch.manual_seed(5)
    lin = FP8Linear(256, 128, bias=False)
    x = torch.randn(8, 256)
    ref = lin(x)
    with BF16Emulation():
        got = lin(x)
    assert torch.equal(got, ref)


def test_uncached_rounding_gives_the_same_numbers_and_saves_no_weight_copy():
    """``cache_weights = False`` (weights gathered per use: trainer.dp): the same output and gradients, bit for
    bit, with no rounded copy of the weight saved for the backward (rounded again there)."""
    torch.manual_seed(6)
    lin = nn.Linear(64, 32)
    x = torch.randn(5, 64)
    results = []
    for cache in (True, False):
        mode = BF16Emulation()
        mode.cache_weights = cache
        lin.zero_grad()
        xi = x.clone().requires_grad_(True)
        copies = []

        def pack(t, copies=copies):
            if t.shape == lin.weight.shape and t.data_ptr() != lin.weight.data_ptr():
                copies.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            y = lin(xi)
        assert len(copies) == (1 if cache else 0)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
