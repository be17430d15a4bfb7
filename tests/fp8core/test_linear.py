"""fp8core.linear: fprop/dgrad/wgrad vs float64 references per recipe (SQNR floors printed), recipe wiring,
outlier channels, scaled_mm vs emulation on CPU, config validation, FP8Linear module behaviour."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fp8core import gemm as cpu_gemm
from fp8core.linear import (
    FP8Linear,
    FP8LinearConfig,
    fp8_linear,
    fp8_linear_forward,
    fp8_mm,
    resolve_backend,
)
from fp8core.quant import dequantize, quantize
from fp8core.spec import FP8Spec

RECIPES = ["blockwise", "rowwise", "tensorwise"]
# SQNR floors (dB) against the exact float64 product, Gaussian data. E4M3 operands give ~28-31 dB, E5M2 gradients
# (hybrid) ~24-25 dB; floors leave ~3 dB margin.
FLOORS = {("fprop", "e4m3"): 26.0, ("dgrad", "e4m3"): 26.0, ("wgrad", "e4m3"): 26.0,
          ("fprop", "hybrid"): 26.0, ("dgrad", "hybrid"): 21.0, ("wgrad", "hybrid"): 21.0}


@pytest.fixture(autouse=True)
def one_thread():
    """Small GEMMs: one thread is faster, and immune to OpenMP spin-waits when the CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sqnr_db(ref, approx):
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def _problem(t=300, k=320, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    dy = torch.randn(t, n, generator=g)
    return x, w, dy


def _run(x, w, dy, bias=None, **kw):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    bb = None if bias is None else bias.clone().requires_grad_()
    y = fp8_linear(xx, ww, bb, **kw)
    y.backward(dy)
    return y.detach(), xx.grad, ww.grad, (None if bb is None else bb.grad)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_three_gemms_vs_float64_sqnr(recipe, fmt):
    x, w, dy = _problem()  # K=320, N=200: partial 128-groups along every contraction dim
    y, dx, dw, _ = _run(x, w, dy, recipe=recipe, fmt=fmt, backend="emulated")
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    measured = {"fprop": sqnr_db(x64 @ w64.t(), y), "dgrad": sqnr_db(dy64 @ w64, dx),
                "wgrad": sqnr_db(dy64.t() @ x64, dw)}
    print(f"SQNR {recipe:10s} {fmt:6s} " + "  ".join(f"{k} {v:.2f} dB" for k, v in measured.items()))
    for gemm, value in measured.items():
        assert value >= FLOORS[(gemm, fmt)], (gemm, value)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_wiring_matches_quantized_operand_reference(recipe, fmt):
    """Each GEMM equals the float64 product of the operands quantized exactly as the module docstring says."""
    x, w, dy = _problem(t=260, k=200, n=136, seed=1)
    b = torch.randn(136)
    y, dx, dw, db = _run(x, w, dy, bias=b, recipe=recipe, fmt=fmt, backend="emulated")
    act = {"blockwise": "group128", "rowwise": "rowwise", "tensorwise": "tensorwise"}[recipe]
    wgr = {"blockwise": "block128", "rowwise": "rowwise", "tensorwise": "tensorwise"}[recipe]
    gfmt = "e5m2" if fmt == "hybrid" else "e4m3"
    d = lambda q: dequantize(q, torch.float64)
    y_ref = d(quantize(x, act)) @ d(quantize(w, wgr)).t() + b.double()
    w_dgrad = quantize(w.t(), "rowwise") if recipe == "rowwise" else quantize(w, wgr).t()
    dx_ref = d(quantize(dy, act, fmt=gfmt)) @ d(w_dgrad).t()
    dw_ref = d(quantize(dy.t(), act, fmt=gfmt)) @ d(quantize(x.t(), act)).t()
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.allclose(db.double(), dy.double().sum(0), rtol=1e-6, atol=1e-4)


def test_bfloat16_io_and_batch_dims():
    torch.manual_seed(2)
    x = torch.randn(2, 50, 256, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(192, 256) / 16).to(torch.bfloat16).requires_grad_()
    b = torch.randn(192, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 50, 192)
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.bfloat16
    ref = F.linear(x.double(), w.double(), b.double())
    s = sqnr_db(ref, y)
    print(f"SQNR bf16 blockwise fprop with batch dims: {s:.2f} dB")
    assert s >= 25.0


def test_outlier_channels_blockwise_beats_tensorwise():
    """A few activation channels 2**14 larger (LLM residual-stream style): a tensorwise scale pushes every other
    channel into E4M3's subnormal range; 1x128 groups confine the damage to the groups that hold outliers."""
    torch.manual_seed(3)
    t, k, n = 256, 1024, 256
    x = torch.randn(t, k)
    x[:, [5, 17, 40]] *= 2.0**14  # outliers in the first 128-group only
    w = torch.randn(n, k) / k**0.5
    rest = slice(128, None)  # the channels of the outlier-free groups
    ch_sq = {g: sqnr_db(x[:, rest], dequantize(quantize(x, g))[:, rest]) for g in ("tensorwise", "group128")}
    y64 = x.double() @ w.double().t()
    out_sq = {r: sqnr_db(y64, fp8_linear(x, w, recipe=r, backend="emulated")) for r in ("blockwise", "tensorwise")}
    # the outlier-free channels' contribution to the product, isolated
    part = {r: sqnr_db(x[:, rest].double() @ w[:, rest].double().t(),
                       dequantize(quantize(x, "group128" if r == "blockwise" else "tensorwise"))[:, rest]
                       @ dequantize(quantize(w, "block128" if r == "blockwise" else "tensorwise"))[:, rest].t())
            for r in ("blockwise", "tensorwise")}
    print(f"outlier channels: SQNR of outlier-free channels {ch_sq}; their GEMM contribution {part}; "
          f"whole output {out_sq}")
    assert ch_sq["group128"] > ch_sq["tensorwise"] + 5.0  # measured ~7.8 dB
    assert part["blockwise"] > part["tensorwise"] + 3.0  # measured ~5.4 dB
    assert out_sq["blockwise"] >= out_sq["tensorwise"]
    # 128x128 weight blocks with outlier rows: same story for the weight
    w_out = w.clone()
    w_out[:4] *= 2.0**14
    wq = {g: sqnr_db(w_out[128:], dequantize(quantize(w_out, g))[128:]) for g in ("tensorwise", "block128")}
    print(f"outlier weight rows: SQNR of the outlier-free blocks {wq}")
    assert wq["block128"] > wq["tensorwise"] + 5.0  # measured ~9.8 dB


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_scaled_mm_matches_emulation_cpu(recipe, fmt, pow2):
    x, w, dy = _problem(t=96, k=200, n=72, seed=4)  # K=200: two 128-chunks, the second partial; N=72 padded to 80
    b = torch.randn(72)
    kw = dict(recipe=recipe, fmt=fmt, pow2_weight=pow2, pow2_activation=pow2)
    emu = _run(x, w, dy, bias=b, backend="emulated", **kw)
    smm = _run(x, w, dy, bias=b, backend="scaled_mm", **kw)
    for e, s in zip(emu, smm, strict=True):
        tol = 2e-6 * e.abs().max().item()
        assert torch.allclose(e, s, rtol=1e-5, atol=tol), (e - s).abs().max().item()


@pytest.mark.parametrize("ga,gb", [("group128", "block128"), ("group128", "group128"), ("rowwise", "rowwise"),
                                   ("tensorwise", "tensorwise"), ("group128", "tensorwise")])
def test_fp8_mm_backends_agree_odd_shapes(ga, gb):
    torch.manual_seed(5)
    a, b = torch.randn(37, 301), torch.randn(29, 301)
    qa, qb = quantize(a, ga), quantize(b, gb, fmt="e5m2")
    emu, smm = fp8_mm(qa, qb, backend="emulated"), fp8_mm(qa, qb, backend="scaled_mm")
    assert smm.shape == (37, 29) and smm.dtype == torch.float32
    assert torch.allclose(emu, smm, rtol=1e-5, atol=1e-5 * emu.abs().max().item())


def test_forward_with_prequantized_weight_is_bit_identical_to_training_forward():
    """End-to-end FP8: what a serving engine computes from quantize(w, 'block128') equals FP8Linear's forward."""
    torch.manual_seed(6)
    lin = FP8Linear(256, 384, bias=True, dtype=torch.bfloat16)
    x = torch.randn(3, 7, 256, dtype=torch.bfloat16)
    served = fp8_linear_forward(x, quantize(lin.weight.detach(), "block128"), lin.bias.detach())
    trained = lin(x)
    assert torch.equal(served, trained.detach())
    assert torch.equal(lin.quantized_weight().data.view(torch.uint8), quantize(lin.weight, "block128").data.view(
        torch.uint8))


def test_fp8_linear_forward_rejects_wrong_weight():
    w = torch.randn(64, 128)
    with pytest.raises(ValueError, match="recipe='blockwise' needs a 'block128' weight.*'rowwise'"):
        fp8_linear_forward(torch.randn(4, 128), quantize(w, "rowwise"))
    with pytest.raises(ValueError, match="does not match weight_q"):
        fp8_linear_forward(torch.randn(4, 100), quantize(w, "block128"))


@pytest.mark.parametrize("field,value,needle", [
    ("recipe", "block", "FP8LinearConfig.recipe='block'.*'blockwise', 'rowwise', 'tensorwise'"),
    ("fmt", "e5m2", "FP8LinearConfig.fmt='e5m2'.*'e4m3', 'hybrid'"),
    ("backend", "cuda", "FP8LinearConfig.backend='cuda'.*'auto', 'cpu', 'emulated', 'scaled_mm'"),
    ("pow2_weight", 1, "FP8LinearConfig.pow2_weight must be a bool"),
])
def test_config_validation_names_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        FP8LinearConfig(**{field: value})


def test_config_frozen_presets_and_backend_resolution():
    c = FP8LinearConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.recipe = "rowwise"
    assert c.recipe == "blockwise" and c.grad_fmt == "e4m3"
    # named recipes resolve in one place, FP8Spec (the trainer's and the engine's): a recipe name sets the recipe
    # only -- pow2 scales are their own keys, as in a YAML recipe
    assert FP8Spec(fmt="hybrid").linear_config().grad_fmt == "e5m2"
    assert FP8Spec(recipe="rowwise").linear_config().pow2_weight is False
    assert FP8Spec(recipe="rowwise", pow2_weight=True).linear_config().pow2_weight is True
    assert FP8Spec(recipe="tensorwise", backend="emulated").linear_config().backend == "emulated"
    with pytest.raises(ValueError, match="FP8Spec.recipe='nope'"):
        FP8Spec(recipe="nope")
    # auto on a CPU: the CPU FP8 GEMM wherever fp8core/csrc built (a build failure is a failure: test_kernels.py)
    from fp8core.cpu import cpu_caps

    native = cpu_gemm.available() and cpu_caps().native_bf16  # the op's FP32 path is slower than torch's GEMM
    assert resolve_backend("auto", torch.device("cpu")) == ("cpu" if native else "emulated")
    assert resolve_backend("scaled_mm", torch.device("cpu")) == "scaled_mm"
    assert resolve_backend("emulated", torch.device("cpu")) == "emulated"


def test_fp8linear_module_switch_and_state_dict():
    torch.manual_seed(7)
    base = nn.Linear(256, 128)
    fp8 = FP8Linear.from_linear(base, FP8LinearConfig(recipe="rowwise"))
    assert fp8.weight is base.weight and fp8.bias is base.bias
    assert list(fp8.state_dict()) == list(base.state_dict()) == ["weight", "bias"]
    x = torch.randn(10, 256)
    y8 = fp8(x)
    assert not torch.equal(y8, base(x)) and sqnr_db(base(x), y8) > 25
    fp8.fp8_enabled = False
    assert torch.equal(fp8(x), base(x))
    assert "recipe=rowwise" in repr(fp8)
    no_bias = FP8Linear(128, 64, bias=False)
    no_bias(torch.randn(3, 128, requires_grad=True)).sum().backward()
    assert no_bias.weight.grad is not None


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 150), k=st.integers(1, 300), n=st.integers(1, 150),
       pair=st.sampled_from([("group128", "block128"), ("group128", "group128"), ("rowwise", "rowwise"),
                             ("tensorwise", "tensorwise")]),
       fmt_a=st.sampled_from(["e4m3", "e5m2"]), seed=st.integers(0, 2**16))
def test_property_scaled_mm_equals_emulation(m, k, n, pair, fmt_a, seed):
    g = torch.Generator().manual_seed(seed)
    qa = quantize(torch.randn(m, k, generator=g), pair[0], fmt=fmt_a)
    qb = quantize(torch.randn(n, k, generator=g), pair[1])
    emu, smm = fp8_mm(qa, qb, backend="emulated"), fp8_mm(qa, qb, backend="scaled_mm")
    # FP32 summation-order noise scales with sum |a_k b_k|, not with the (possibly cancelled) result: a 1x77 @ 77x1
    # product of 0.054 differed by 5.9e-7 (1.1e-5 of the result, 1e-7 of sum |a_k b_k|)
    scale = (dequantize(qa).abs() @ dequantize(qb).abs().t()).max().item() + 1e-30
    assert smm.shape == (m, n) and (emu - smm).abs().max().item() <= 1e-5 * scale


# ------------------------------------------------------------------ fast emulation == the plain reference operands
from fp8core.linear import WeightCache  # noqa: E402
from fp8core.quant import quantize_reference  # noqa: E402


def _reference_three_gemms(x, w, dy, recipe, fmt):
    """fprop / dgrad / wgrad from quantize_reference operands (the plain path), FP32 products."""
    cfg = FP8LinearConfig(recipe=recipe, fmt=fmt)
    act = {"blockwise": "group128", "rowwise": "rowwise", "tensorwise": "tensorwise"}[recipe]
    wg = {"blockwise": "block128", "rowwise": "rowwise", "tensorwise": "tensorwise"}[recipe]
    dq = lambda t, g, f="e4m3": dequantize(quantize_reference(t, g, fmt=f))  # noqa: E731
    y = dq(x, act) @ dq(w, wg).t()
    w_nk = dq(w.t(), "rowwise").t() if recipe == "rowwise" else dq(w, wg)
    dx = dq(dy, act, cfg.grad_fmt) @ w_nk
    dw = dq(dy.t(), act, cfg.grad_fmt) @ dq(x.t(), act).t()
    return y, dx, dw


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_emulated_gemms_use_reference_operands(recipe, fmt):
    """The fast emulation multiplies exactly the reference path's dequantized operands: fprop is bit-identical, and
    dgrad/wgrad (whose operands are laid out differently for the GEMM) agree to FP32 summation-order rounding."""
    x, w, dy = _problem(t=300, k=320, n=200)
    y, dx, dw, _ = _run(x, w, dy, recipe=recipe, fmt=fmt, backend="emulated")
    y_ref, dx_ref, dw_ref = _reference_three_gemms(x, w, dy, recipe, fmt)
    assert torch.equal(y, y_ref)
    for got, ref in ((dx, dx_ref), (dw, dw_ref)):
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_weight_cache_reuses_until_the_weight_changes():
    """One quantization per weight version: reused across forwards, rebuilt after an optimizer step, a
    load_state_dict, a swapped Parameter or a config change; always equal to a fresh quantize."""
    torch.manual_seed(3)
    lin = FP8Linear(256, 128, bias=False)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    first = lin.quantized_weight()
    assert lin.quantized_weight() is first
    x = torch.randn(16, 256)
    lin(x).sum().backward()
    assert lin.quantized_weight() is first  # forward + backward do not change the weight
    opt.step()
    second = lin.quantized_weight()
    assert second is not first
    assert torch.equal(second.data.view(torch.uint8), quantize(lin.weight, "block128").data.view(torch.uint8))
    lin.load_state_dict({"weight": torch.randn(128, 256)})
    third = lin.quantized_weight()
    assert third is not second and torch.equal(third.scale, quantize(lin.weight, "block128").scale)
    lin.weight = nn.Parameter(torch.randn(128, 256))
    assert torch.equal(lin.quantized_weight().scale, quantize(lin.weight, "block128").scale)
    lin.config = FP8LinearConfig(recipe="tensorwise")
    assert lin.quantized_weight().granularity == "tensorwise"


def test_weight_cache_in_training_matches_uncached_training():
    """Two AdamW updates with gradient accumulation over micro-batches: the cached module and the cache-free
    functional fp8_linear produce bit-identical weights."""
    torch.manual_seed(4)
    w0 = torch.randn(128, 256) / 16
    mod = FP8Linear(256, 128, bias=False)
    mod.weight = nn.Parameter(w0.clone())
    w_fn = nn.Parameter(w0.clone())
    opts = [torch.optim.AdamW([mod.weight], lr=1e-2), torch.optim.AdamW([w_fn], lr=1e-2)]
    xs = [torch.randn(40, 256) for _ in range(4)]
    for step in range(2):
        for o in opts:
            o.zero_grad()
        for x in xs[2 * step: 2 * step + 2]:
            mod(x).square().mean().backward()
            fp8_linear(x, w_fn).square().mean().backward()
        for o in opts:
            o.step()
    assert torch.equal(mod.weight, w_fn)


def test_weight_cache_clear_and_standalone():
    cache = WeightCache()
    w = torch.randn(64, 256)
    q1, dq1 = cache.get(w, FP8LinearConfig(), dequantized=True)
    assert torch.equal(dq1, dequantize(quantize_reference(w, "block128")))
    with torch.no_grad():
        w.data.mul_(2)  # bypasses the version counter: invisible until clear()
    assert cache.get(w, FP8LinearConfig())[0] is q1
    cache.clear()
    assert torch.equal(cache.get(w, FP8LinearConfig())[0].scale, quantize(w, "block128").scale)


def _saved_copies_of(weight: torch.Tensor, run) -> int:
    """How many tensors of ``weight``'s shape other than ``weight`` itself autograd saves while ``run()`` builds
    its graph (a cached quantized / dequantized copy of the weight would be one)."""
    copies = []

    def pack(t):
        if t.shape == weight.shape and t.data_ptr() != weight.data_ptr():
            copies.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, len(copies)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "tensorwise"])
def test_uncached_module_trains_bit_identically_and_saves_no_weight_copy(recipe):
    """``weight_cache = None`` (a weight gathered per use: trainer.dp's per-layer sharding): the same output and
    gradients, bit for bit, as the cached module, with only the weight itself saved for the backward (quantized
    again there)."""
    torch.manual_seed(5)
    config = FP8LinearConfig(recipe=recipe, backend="emulated")
    cached = FP8Linear(256, 128, bias=True, config=config)
    uncached = FP8Linear(256, 128, bias=True, config=config)
    uncached.load_state_dict(cached.state_dict())
    uncached.weight_cache = None
    x = torch.randn(2, 24, 256)
    grads = []
    for mod, want_copies in ((cached, 1), (uncached, 0)):
        xi = x.clone().requires_grad_(True)
        y, copies = _saved_copies_of(mod.weight, lambda m=mod, xi=xi: m(xi))
        assert copies == want_copies, (recipe, copies)
        y.square().mean().backward()
        grads.append((y.detach(), xi.grad, mod.weight.grad, mod.bias.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(uncached.quantized_weight().data.view(torch.uint8),
                       cached.quantized_weight().data.view(torch.uint8))
