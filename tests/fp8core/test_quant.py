"""fp8core.quant: float64 reference per granularity, SQNR floors, round-trip bounds, saturation, pow2, edge table,
hypothesis properties."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8core.quant import (
    E4M3_MAX,
    E5M2_MAX,
    FP8_DTYPES,
    GRANULARITIES,
    MIN_SCALE,
    QuantizedTensor,
    dequantize,
    expand_scale,
    quantize,
)

FMAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
# half an ulp relative to |x| (3 resp. 2 mantissa bits) and half the smallest subnormal (2**-9 resp. 2**-16), in scale units
REL_HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
ABS_HALF_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


# ---------------------------------------------------------------- float64 reference (independent of fp8core.quant)
def _fp8_grid(fmt: str) -> torch.Tensor:
    """All non-negative finite values of the format, in code order (= value order), as float64."""
    codes = torch.arange(0, 128, dtype=torch.uint8)
    vals = codes.view(FP8_DTYPES[fmt]).double()
    return vals[torch.isfinite(vals)]


def _round_to_fp8_ref(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round float64 values (|v| <= max) to the nearest FP8 value, ties to the even code, in float64."""
    grid = _fp8_grid(fmt)
    a = v.abs().flatten()
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    idx = torch.where(pick_hi, hi, lo)
    return (torch.sign(v.flatten()) * grid[idx]).reshape(v.shape)


def _groups_ref(m: int, k: int, granularity: str):
    """List of (row slice, col slice) per scale entry, in scale order, for a 2-D [m, k] tensor."""
    if granularity == "tensorwise":
        return [[(slice(0, m), slice(0, k))]]
    if granularity == "rowwise":
        return [[(slice(i, i + 1), slice(0, k))] for i in range(m)]
    if granularity in ("group128", "group32"):
        g = 128 if granularity == "group128" else 32
        return [[(slice(i, i + 1), slice(j, min(j + g, k))) for j in range(0, k, g)] for i in range(m)]
    return [[(slice(i, min(i + 128, m)), slice(j, min(j + 128, k))) for j in range(0, k, 128)] for i in range(0, m, 128)]


def quantize_ref(x: torch.Tensor, granularity: str, fmt: str, pow2: bool = False):
    x64 = x.double()
    m, k = x64.shape
    groups = _groups_ref(m, k, granularity)
    scale = torch.empty(len(groups), len(groups[0]), dtype=torch.float64)
    data = torch.empty_like(x64)
    for i, row in enumerate(groups):
        for j, (rs, cs) in enumerate(row):
            s = x64[rs, cs].abs().max().item() / FMAX[fmt]
            s = max(float(torch.tensor(s, dtype=torch.float32)), MIN_SCALE)  # stored as FP32
            if pow2:
                s = 2.0 ** math.ceil(math.log2(s))
            scale[i, j] = s
            data[rs, cs] = _round_to_fp8_ref((x64[rs, cs] / s).clamp(-FMAX[fmt], FMAX[fmt]), fmt)
    if granularity == "tensorwise":
        scale = scale.reshape(())
    return data, scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("pow2", [False, True])
def test_matches_float64_reference(granularity, fmt, pow2):
    torch.manual_seed(1)
    x = torch.randn(150, 300) * torch.logspace(-3, 3, 300)  # columns with very different magnitudes
    q = quantize(x, granularity, fmt=fmt, pow2=pow2)
    data_ref, scale_ref = quantize_ref(x, granularity, fmt, pow2)
    assert q.scale.dtype == torch.float32 and q.data.dtype == FP8_DTYPES[fmt]
    assert torch.equal(q.scale.double(), scale_ref)
    assert torch.equal(q.data.double(), data_ref)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_scale_shapes_partial_groups(granularity):
    x = torch.randn(130, 257)
    expected = {"tensorwise": (), "rowwise": (130, 1), "group128": (130, 3), "group32": (130, 9),
                "block128": (2, 3)}[granularity]
    q = quantize(x, granularity)
    assert tuple(q.scale.shape) == expected and q.data.shape == x.shape


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "group128", "block128"])
def test_leading_batch_dims(granularity):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 140, 200)
    q = quantize(x, granularity)
    if granularity == "block128":  # tiles the last two dims of each batch entry
        ref = [quantize(x[i, j], granularity) for i in range(2) for j in range(3)]
        assert torch.equal(q.scale.reshape(6, 2, 2), torch.stack([r.scale for r in ref]))
        assert torch.equal(q.data.float().reshape(6, 140, 200), torch.stack([r.data.float() for r in ref]))
    elif granularity == "tensorwise":
        assert torch.equal(q.data.float().reshape(-1, 200), quantize(x.reshape(-1, 200), granularity).data.float())
    else:
        flat = quantize(x.reshape(-1, 200), granularity)
        assert torch.equal(q.scale.reshape(flat.scale.shape), flat.scale)
        assert torch.equal(q.data.float().reshape(-1, 200), flat.data.float())
    assert torch.allclose(dequantize(q), x, rtol=0.07, atol=0.02)


@pytest.mark.parametrize("fmt,floor", [("e4m3", 25.0), ("e5m2", 20.0)])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_sqnr_floor_gaussian(granularity, fmt, floor):
    torch.manual_seed(3)
    x = torch.randn(512, 1024)
    s = sqnr_db(x, dequantize(quantize(x, granularity, fmt=fmt)))
    print(f"SQNR {fmt} {granularity:10s} gaussian: {s:.2f} dB (floor {floor})")
    assert s >= floor


def test_plain_cast_sqnr_and_rounding_matches_torch_cast():
    """With amax = 448 and pow2 the scale is exactly 1, so quantize is torch's own cast (round-to-nearest-even)."""
    torch.manual_seed(4)
    x = torch.randn(4096) * 60
    x[0] = 448.0
    q = quantize(x, "tensorwise", pow2=True)
    assert q.scale.item() == 1.0
    assert torch.equal(q.data.float(), x.to(torch.float8_e4m3fn).float())
    s = sqnr_db(x, x.to(torch.float8_e4m3fn).float())
    print(f"SQNR plain E4M3 cast of Gaussian*60: {s:.2f} dB")
    assert s >= 25.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_round_trip_bound_per_element(granularity, fmt):
    torch.manual_seed(5)
    x = torch.randn(200, 300) * torch.logspace(-4, 2, 300)
    q = quantize(x, granularity, fmt=fmt)
    err = (dequantize(q).double() - x.double()).abs()
    s = q.expanded_scale().double()
    bound = REL_HALF_ULP[fmt] * x.double().abs() + ABS_HALF_SUBNORMAL[fmt] * s
    assert bool((err <= bound * (1 + 1e-6)).all()), f"worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation_at_max(fmt):
    x = torch.tensor([[-3.0, 1.0, 3.0, 0.5, -2.9999]])
    q = quantize(x, "rowwise", fmt=fmt)
    d = q.data.float()
    assert d.abs().max().item() == FMAX[fmt]
    assert d[0, 0].item() == -FMAX[fmt] and d[0, 2].item() == FMAX[fmt]
    assert torch.allclose(dequantize(q)[0, [0, 2]], x[0, [0, 2]])


def test_pow2_scales():
    torch.manual_seed(6)
    x = torch.randn(256, 384) * torch.logspace(-5, 5, 384)
    for granularity in GRANULARITIES:
        q = quantize(x, granularity, pow2=True)
        plain = quantize(x, granularity)
        mant, _ = torch.frexp(q.scale)
        assert bool((mant == 0.5).all()), granularity  # exact powers of two
        assert bool((q.scale >= plain.scale).all()) and bool((q.scale < 2 * plain.scale).all())
        assert q.data.float().abs().max().item() <= E4M3_MAX  # never needs saturation
        # data * 2**e is exact in FP32
        assert torch.equal(dequantize(q, torch.float64), q.data.double() * q.expanded_scale().double())
    exact = torch.tensor([448.0, 1.0])  # amax/448 = 1 is already a power of two: must stay 1, not 2
    assert quantize(exact, "tensorwise", pow2=True).scale.item() == 1.0


def test_deterministic_bit_identical():
    torch.manual_seed(7)
    w = torch.randn(384, 300, dtype=torch.bfloat16)
    a, b = quantize(w, "block128"), quantize(w.clone(), "block128")
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_block128_transpose_symmetric():
    torch.manual_seed(8)
    w = torch.randn(300, 200)
    a, b = quantize(w, "block128").t(), quantize(w.t().contiguous(), "block128")
    assert torch.equal(a.data.float(), b.data.float()) and torch.equal(a.scale, b.scale)


# ---------------------------------------------------------------- edge table
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_edge_all_zero(granularity):
    q = quantize(torch.zeros(3, 130), granularity)
    assert bool(torch.isfinite(q.scale).all()) and bool((q.scale > 0).all())
    assert bool((q.data.float() == 0).all()) and bool((dequantize(q) == 0).all())


def test_edge_zero_group_next_to_nonzero_group():
    x = torch.zeros(2, 256)
    x[0, :128] = torch.linspace(-1, 1, 128)
    q = quantize(x, "group128")
    assert q.scale[0, 0].item() == pytest.approx(1 / 448)
    assert q.scale[0, 1].item() == MIN_SCALE and q.scale[1, 0].item() == MIN_SCALE
    assert torch.equal(dequantize(q)[:, 128:], x[:, 128:])


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_edge_non_finite_rejected(bad, granularity):
    x = torch.randn(4, 140)
    x[2, 7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, granularity)


def test_edge_float64_beyond_fp32_range_rejected():
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([1e300, 1.0], dtype=torch.float64), "tensorwise")


def test_edge_subnormal_inputs():
    # FP32 subnormals: amax/448 underflows -> scale floored at 2**-126, finite, no nan
    x = torch.tensor([[1e-40, -3e-41, 0.0, 1e-45]])
    for granularity in GRANULARITIES:
        q = quantize(x, granularity)
        assert q.scale.min().item() >= MIN_SCALE and bool(torch.isfinite(dequantize(q)).all())
        assert (dequantize(q, torch.float64) - x.double()).abs().max().item() <= 2**-10 * MIN_SCALE * 1.0001


def test_edge_fp8_subnormal_range():
    """With scale 1: E4M3 normals start at 2**-6; below, subnormals are multiples of 2**-9 with ties to even."""
    x = torch.tensor([448.0, 448 * 2**-12, 448 * 2**-16, 2**-9, 3 * 2**-10, 448 * 2**-20])
    q = quantize(x, "tensorwise")
    assert q.scale.item() == 1.0
    # 0.109375 normal; 448*2**-16 = 3.5 * 2**-9 -> 4 * 2**-9 (even); 2**-9 kept; 1.5 * 2**-9 -> 2 * 2**-9; tiny -> 0
    assert q.data.float().tolist() == [448.0, 0.109375, 0.0078125, 0.001953125, 0.00390625, 0.0]


def test_edge_fp32_max_is_finite():
    x = torch.tensor([3.0e38, -3.0e38, 1.0])
    q = quantize(x, "rowwise")
    assert bool(torch.isfinite(q.scale).all()) and bool(torch.isfinite(dequantize(q)).all())
    assert dequantize(q)[0].item() == pytest.approx(3.0e38, rel=1e-6)


def test_bfloat16_and_float16_inputs():
    torch.manual_seed(9)
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(64, 256, dtype=dt)
        q = quantize(x, "group128")
        ref = quantize(x.float(), "group128")
        assert torch.equal(q.scale, ref.scale) and torch.equal(q.data.float(), ref.data.float())
        assert dequantize(q, dt).dtype == dt


@pytest.mark.parametrize("kwargs,needle", [
    ({"granularity": "blockwise"}, "granularity='blockwise'.*allowed: 'tensorwise', 'rowwise', 'group128', 'group32', 'block128'"),
    ({"granularity": "rowwise", "fmt": "e3m4"}, "fmt='e3m4'.*allowed: 'e4m3', 'e5m2'"),
    ({"granularity": "block128", "x": torch.randn(5)}, "block128.*2-D"),
    ({"granularity": "rowwise", "x": torch.randn(4).to(torch.float8_e4m3fn)}, "high-precision"),
])
def test_bad_arguments_named(kwargs, needle):
    kwargs = dict(kwargs)
    x = kwargs.pop("x", torch.randn(4, 4))
    with pytest.raises(ValueError, match=needle):
        quantize(x, **kwargs)


def test_quantized_tensor_validates():
    q = quantize(torch.randn(4, 256), "group128")
    with pytest.raises(ValueError, match="scale has shape"):
        QuantizedTensor(q.data, q.scale[:, :1], "group128", "e4m3")
    with pytest.raises(ValueError, match="fmt='e5m2' needs"):
        QuantizedTensor(q.data, q.scale, "group128", "e5m2")
    with pytest.raises(ValueError, match="t\\(\\) needs"):
        q.t()


# ---------------------------------------------------------------- hypothesis properties
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 200),
    k=st.integers(1, 300),
    granularity=st.sampled_from(GRANULARITIES),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    pow2=st.booleans(),
    log_mag=st.floats(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip_relative_to_group_amax(m, k, granularity, fmt, pow2, log_mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (2.0**log_mag)
    x = x * (torch.rand(m, k, generator=g) > 0.1)  # some exact zeros
    q = quantize(x, granularity, fmt=fmt, pow2=pow2)
    assert bool(torch.isfinite(q.scale).all()) and bool((q.scale > 0).all())
    # group amax broadcast to elements, via the scale: amax <= scale * fp8_max
    group_amax = expand_scale(q.scale.double(), granularity, x.shape) * FMAX[fmt]
    err = (dequantize(q).double() - x.double()).abs()
    assert bool((err <= REL_HALF_ULP[fmt] * group_amax * (1 + 1e-6)).all())
    assert q.data.float().abs().max().item() <= FMAX[fmt]


# ------------------------------------------------------------------ fast paths == the plain reference, bit for bit
from fp8core import quant_chunked as _quant  # noqa: E402 (the torch-ops path quantize calls)
from fp8core.quant import (  # noqa: E402
    quantize_columns,
    quantize_dequantize,
    quantize_dequantize_columns,
    quantize_reference,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.dtype == torch.float32 else t


def _edge_matrix(m: int, k: int, fmt: str, seed: int = 0) -> torch.Tensor:
    """Gaussian rows of widely different magnitudes plus the edge table: all-zero and -0.0 rows, FP32 subnormals,
    values in the FP8 subnormal range of their group, exact saturation (group amax = fp8_max * 2**j), FP8 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 4, m).unsqueeze(1)
    fmax = FMAX[fmt]
    grid = _fp8_grid(fmt)
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact ties between neighbouring FP8 values (for scale 1)
    rows = [
        torch.zeros(k),
        torch.full((k,), -0.0),
        torch.full((k,), 1e-40) * torch.linspace(-1, 1, k),  # FP32 subnormals (scale floor 2**-126)
        torch.cat([torch.tensor([fmax]), mids]).repeat(k // len(mids) + 1)[:k],  # amax = fp8_max: exact ties
        torch.cat([torch.tensor([-fmax * 4.0]), mids * 4]).repeat(k // len(mids) + 1)[:k],
        torch.linspace(-fmax, fmax, k) * 2.0**-12,
    ]
    for i, r in enumerate(rows[: m]):
        x[i * 7 % m] = r
    return x


SHAPES_2D = [(1, 1), (3, 5), (7, 129), (130, 200), (257, 128), (300, 1000)]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_columns_is_quantize_of_the_transpose(granularity, fmt, pow2, dtype):
    """quantize_columns(x) (the wgrad operands, quantized along tokens in x's own layout) equals quantize(x.t()) bit
    for bit, codes and scales, on every shape and the edge table (the edge rows become edge columns)."""
    for m, k in SHAPES_2D:
        x = _edge_matrix(k, m, fmt).t().contiguous().to(dtype)  # [m, k]: the edge rows of x.t()
        ref = quantize_reference(x.t(), granularity, fmt=fmt, pow2=pow2)
        got = quantize_columns(x, granularity, fmt=fmt, pow2=pow2)
        assert got.data.shape == ref.data.shape and got.granularity == granularity, (m, k)
        assert torch.equal(_bits(got.data.contiguous()), _bits(ref.data)), (m, k)
        assert torch.equal(_bits(got.scale), _bits(ref.scale)), (m, k)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fast_quantize_bit_identical_to_reference(granularity, fmt, pow2, dtype, monkeypatch):
    """The chunked quantize / quantize_dequantize equal the plain whole-tensor reference on every shape (partial groups,
    partial blocks) and the edge table, with chunks small enough that every shape spans several of them."""
    monkeypatch.setattr(_quant, "_CHUNK_BYTES", 4096)
    for m, k in SHAPES_2D:
        x = _edge_matrix(m, k, fmt).to(dtype)
        ref = quantize_reference(x, granularity, fmt=fmt, pow2=pow2)
        got = quantize(x, granularity, fmt=fmt, pow2=pow2)
        assert torch.equal(_bits(got.data), _bits(ref.data)), (m, k)
        assert torch.equal(_bits(got.scale), _bits(ref.scale)), (m, k)
        dq, q = quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2, keep_data=True)
        assert torch.equal(_bits(q.data), _bits(ref.data)) and torch.equal(q.scale, ref.scale)
        assert torch.equal(_bits(dq), _bits(dequantize(ref))), (m, k)
        dq_only, _ = quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2)  # FP32 grid rounding, no FP8 codes
        assert torch.equal(_bits(dq_only), _bits(dequantize(ref))), (m, k)
        if granularity != "block128":
            cols = quantize_dequantize_columns(x, granularity, fmt=fmt, pow2=pow2)
            ref_t = dequantize(quantize_reference(x.t(), granularity, fmt=fmt, pow2=pow2)).t()
            assert torch.equal(_bits(cols), _bits(ref_t)), (m, k)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fast_quantize_batched_and_transposed_inputs(granularity, monkeypatch):
    monkeypatch.setattr(_quant, "_CHUNK_BYTES", 8192)
    x = torch.randn(3, 40, 300)
    for inp in (x, x.transpose(0, 1), x[0].t(), x[..., :130]):
        ref = quantize_reference(inp, granularity)
        got = quantize(inp, granularity)
        assert torch.equal(_bits(got.data), _bits(ref.data)) and torch.equal(got.scale, ref.scale)
        assert torch.equal(quantize_dequantize(inp, granularity)[0], dequantize(ref))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp32_grid_rounding_equals_torch_fp8_cast(fmt):
    """_round_to_fp8_grid_ == x.to(fp8).to(float32) bit for bit: every tie between neighbouring FP8 values and the
    FP32 neighbours of each tie and of each FP8 value, both signs; a dense sweep of every FP32 value in two binades
    (one normal, one subnormal for FP8); FP32 subnormals; signed zeros."""
    grid = _fp8_grid(fmt).float()
    grid = grid[grid <= FMAX[fmt]]
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids])
    near = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, math.inf)),
                      torch.nextafter(pts, torch.zeros_like(pts))])
    lo_exp = -7 if fmt == "e4m3" else -15
    dense = []
    for e in (lo_exp, 1):  # all 2**23 FP32 values of [2**e, 2**(e+1))
        base = torch.tensor(2.0**e).view(torch.int32)
        dense.append((base + torch.arange(0, 1 << 23, dtype=torch.int32)).view(torch.float32))
    v = torch.cat([near, *dense, torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126])])
    v = v[v.abs() <= FMAX[fmt]]
    v = torch.cat([v, -v])
    ref = v.to(FP8_DTYPES[fmt]).to(torch.float32)
    got = _quant._round_to_fp8_grid_(v.clone(), torch.empty(v.shape, dtype=torch.int32), fmt)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_table_equals_torch_cast(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[fmt]).reshape(16, 16)
    for data in (codes, codes.t(), codes[::2, 1:]):
        assert torch.equal(_quant._fp8_to_fp32(data).view(torch.int32), data.to(torch.float32).view(torch.int32))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fast_paths_reject_non_finite(bad, granularity, monkeypatch):
    monkeypatch.setattr(_quant, "_CHUNK_BYTES", 4096)
    x = torch.randn(300, 200)
    x[257, 3] = bad  # in the last chunk
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, granularity)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_dequantize(x, granularity)
    if granularity != "block128":
        with pytest.raises(ValueError, match="non-finite"):
            quantize_dequantize_columns(x, granularity)


# ---------------------------------------------------------------------------------------------- off the CPU
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_quantizer_gives_the_cpu_quantizers_bits(granularity, fmt, pow2, dtype):
    """What quantize runs off the CPU (quantize_on_device, run here on CPU tensors) against the CPU quantizer (its
    fused kernel / chunked path): the same codes and scales on every shape and the edge table, 3-D and transposed
    inputs too, and its device flag stays clear on finite input."""
    from fp8core.quant import nonfinite_seen, quantize_on_device

    nonfinite_seen("cpu")
    for m, k in SHAPES_2D:
        x = _edge_matrix(m, k, fmt).to(dtype)
        for inp in (x, x.t()) if granularity != "block128" else (x,):
            want = quantize(inp, granularity, fmt=fmt, pow2=pow2)
            got = quantize_on_device(inp, granularity, fmt=fmt, pow2=pow2)
            assert torch.equal(_bits(got.data.contiguous()), _bits(want.data.contiguous())), (m, k)
            assert torch.equal(_bits(got.scale), _bits(want.scale)), (m, k)
    if granularity in ("group128", "rowwise"):
        x3 = torch.randn(2, 5, 300).to(dtype)
        assert torch.equal(_bits(quantize_on_device(x3, granularity, fmt=fmt).data),
                           _bits(quantize(x3, granularity, fmt=fmt).data))
    assert not nonfinite_seen("cpu")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_device_quantizer_flags_non_finite_input_without_reading_the_device(bad):
    """Off the CPU a non-finite group cannot raise without a host read: its scale comes out non-finite and the bad
    value's code NaN, so a GEMM over it gives NaN (the other groups are untouched); the device's flag is set, and
    nonfinite_seen reads and clears it."""
    from fp8core.quant import nonfinite_seen, quantize_on_device

    nonfinite_seen("cpu")
    x = torch.randn(4, 384)
    x[2, 200] = bad
    q = quantize_on_device(x, "group128")
    assert not bool(q.scale[2, 1].isfinite()) and bool(q.data[2, 200].float().isnan())
    clean = quantize(torch.cat([x[:2], x[3:]]), "group128")
    assert torch.equal(_bits(torch.cat([q.data[:2], q.data[3:]])), _bits(clean.data))
    assert nonfinite_seen("cpu") and not nonfinite_seen("cpu")
    with pytest.raises(ValueError, match="non-finite"):  # the CPU quantizer raises at once
        quantize(x, "group128")


def test_quantize_runs_on_the_meta_device():
    """On the meta device no value can be read back to the host: quantize and its companions run there (what a GPU
    runs, with no synchronization) and give the CPU's shapes, dtypes and layouts."""
    for gran in GRANULARITIES:
        x = torch.empty(300, 520, device="meta")
        q = quantize(x, gran, fmt="e5m2")
        ref = quantize(torch.zeros(300, 520), gran, fmt="e5m2")
        assert q.data.device.type == "meta" and q.data.dtype == ref.data.dtype
        assert q.data.shape == ref.data.shape and q.scale.shape == ref.scale.shape
        assert quantize_dequantize(x, gran)[0].shape == (300, 520)
        if gran != "block128":
            assert quantize_columns(x, gran).data.shape == (520, 300)
            assert quantize_dequantize_columns(x, gran).shape == (300, 520)
