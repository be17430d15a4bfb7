"""FP8 quantization: formats, scale convention and granularities.

Formats
-------
* ``"e4m3"`` -> ``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinities, largest finite value 448.
  More precision, less range: used for weights and activations (and for gradients in the plain "e4m3" recipes).
* ``"e5m2"`` -> ``torch.float8_e5m2``: 5 exponent bits, 2 mantissa bits, IEEE-like (has inf/nan), largest finite 57344.
  Less precision, more range: the "hybrid" training format uses it for gradients, whose dynamic range is wider.

Scale convention (the one vLLM and DeepSeek-V3 checkpoints use, and what nanochat's fp8.py / torchao's float8 compute
under another name)
-------------------------------------------------------------------------------------------------------------------
A scale is an FP32 *dequantization multiplier*, one per group of elements::

    amax  = max |x| over the group                (exact: max involves no rounding)
    scale = amax / fp8_max                          (one IEEE FP32 division -> deterministic, bit-reproducible)
    data  = cast_fp8(clamp(x / scale, -fp8_max, fp8_max))
    x    ~= data * scale

torchao stores the reciprocal (``fp8_max / amax``, a *quantization* multiplier); vLLM calls our ``scale``
``weight_scale_inv``. The cast is torch's own ``.to(float8)``, i.e. round-to-nearest-even, so ``quantize`` agrees
bit-for-bit with anything else that divides by the same FP32 scale and casts with torch.

* ``pow2=True`` rounds each scale *up* to a power of two, ``scale = 2 ** ceil(log2(amax / fp8_max))`` (computed exactly
  with frexp, no log2 rounding). Rounding up guarantees ``|x| / scale <= fp8_max`` (no saturation) and makes
  ``data * scale`` exact in FP32. (torchao's rowwise recipe rounds its reciprocal scale *down*, the same thing.)
* An all-zero group (amax 0) or one whose amax is so small that ``amax / fp8_max`` would leave the normal FP32 range
  gets ``scale = 2**-126`` (the smallest normal FP32): finite, positive, and zero data for zeros.
* Non-finite input (inf / nan, or float64 values beyond the FP32 range) is rejected with a ValueError: a scale built
  from an infinite amax would silently zero the whole group.

Granularities (for a 2-D ``x`` of shape ``[M, K]``; ``K`` is the contraction dim when x is a GEMM operand)
------------------------------------------------------------------------------------------------------------
=============  ================================  ============================================================
granularity    scale shape                        group
=============  ================================  ============================================================
tensorwise     ``[]``                             the whole tensor
rowwise        ``[M, 1]``                         one row (all of the last dim)
group128       ``[M, ceil(K/128)]``               1x128 slices of the last dim (activations, gradients)
block128       ``[ceil(M/128), ceil(K/128)]``     128x128 tiles of the last two dims (weights)
=============  ================================  ============================================================

Leading batch dims are kept (``[B, T, K]`` rowwise -> ``[B, T, 1]``; group128 -> ``[B, T, ceil(K/128)]``; block128
tiles the last two dims of each batch entry). Partial trailing groups/blocks are fine: their amax is taken over the
elements that exist. block128 is transpose-symmetric: ``quantize(w.T, "block128")`` equals ``quantize(w, "block128")``
transposed (``QuantizedTensor.t()``), which is why one quantized weight serves both the forward and the dgrad GEMM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
GROUP = 128
GRANULARITIES = ("tensorwise", "rowwise", "group128", "block128")
FORMATS = ("e4m3", "e5m2")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
MIN_SCALE = 2.0**-126  # smallest normal FP32: the floor applied to every scale

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FORMATS",
    "FP8_DTYPES",
    "FP8_MAX",
    "GRANULARITIES",
    "QuantizedTensor",
    "dequantize",
    "expand_scale",
    "quantize",
]


def _check_choice(value, allowed, what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """An FP8 tensor with its FP32 dequantization scales: ``x ~= data * expand(scale)``.

    ``data`` has the shape of the original tensor; ``scale`` the shape given by ``granularity`` (module docstring).
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    fmt: str

    def __post_init__(self):
        _check_choice(self.granularity, GRANULARITIES, "granularity")
        _check_choice(self.fmt, FORMATS, "fmt")
        if self.data.dtype != FP8_DTYPES[self.fmt]:
            raise ValueError(f"QuantizedTensor.data has dtype {self.data.dtype}, fmt={self.fmt!r} needs "
                             f"{FP8_DTYPES[self.fmt]}")
        if self.scale.dtype != torch.float32:
            raise ValueError(f"QuantizedTensor.scale must be float32, got {self.scale.dtype}")
        expected = _scale_shape(tuple(self.data.shape), self.granularity)
        if tuple(self.scale.shape) != expected:
            raise ValueError(f"QuantizedTensor.scale has shape {tuple(self.scale.shape)}, expected {expected} for "
                             f"data of shape {tuple(self.data.shape)} and granularity={self.granularity!r}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.fmt]

    def expanded_scale(self) -> torch.Tensor:
        """The scale broadcast to ``data``'s shape (FP32)."""
        return expand_scale(self.scale, self.granularity, self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def t(self) -> QuantizedTensor:
        """Transpose of a 2-D tensorwise or block128 tensor (exact: those groupings are transpose-symmetric)."""
        if self.data.dim() != 2 or self.granularity not in ("tensorwise", "block128"):
            raise ValueError(f"QuantizedTensor.t() needs a 2-D tensorwise/block128 tensor, got "
                             f"granularity={self.granularity!r} with shape {tuple(self.data.shape)}")
        scale = self.scale if self.granularity == "tensorwise" else self.scale.t()
        return QuantizedTensor(self.data.t(), scale, self.granularity, self.fmt)

    def to(self, device) -> QuantizedTensor:
        return QuantizedTensor(self.data.to(device), self.scale.to(device), self.granularity, self.fmt)


def _scale_shape(shape: tuple[int, ...], granularity: str) -> tuple[int, ...]:
    if granularity == "tensorwise":
        return ()
    if len(shape) == 0:
        raise ValueError(f"granularity={granularity!r} needs at least a 1-D tensor, got a 0-d tensor")
    if granularity == "rowwise":
        return (*shape[:-1], 1)
    if granularity == "group128":
        return (*shape[:-1], math.ceil(shape[-1] / GROUP))
    if len(shape) < 2:
        raise ValueError(f"granularity='block128' needs at least a 2-D tensor, got shape {shape}")
    return (*shape[:-2], math.ceil(shape[-2] / GROUP), math.ceil(shape[-1] / GROUP))


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    pad = (-size) % multiple
    if pad == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = pad
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def _round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale (scale > 0, finite), exactly: frexp gives scale = m * 2**e with m in [0.5, 1)."""
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def expand_scale(scale: torch.Tensor, granularity: str, shape) -> torch.Tensor:
    """Broadcast a ``granularity`` scale tensor to a data tensor of ``shape`` (partial groups cropped)."""
    _check_choice(granularity, GRANULARITIES, "granularity")
    shape = tuple(shape)
    if granularity in ("tensorwise", "rowwise"):
        return scale.expand(shape)
    if granularity == "group128":
        return scale.repeat_interleave(GROUP, dim=-1)[..., : shape[-1]]
    return scale.repeat_interleave(GROUP, dim=-2).repeat_interleave(GROUP, dim=-1)[..., : shape[-2], : shape[-1]]


def quantize(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """Quantize ``x`` to FP8 with one FP32 dequantization scale per group (module docstring).

    ``scale = amax / fp8_max`` (``2**ceil(log2(.))`` if ``pow2``), floored at 2**-126;
    ``data = fp8(clamp(x / scale, +-fp8_max))`` with torch's round-to-nearest-even cast.
    Source of the convention: DeepSeek-V3 / vLLM block FP8 (``weight_scale_inv``), torchao float8 (reciprocal form).
    """
    _check_choice(granularity, GRANULARITIES, "granularity")
    _check_choice(fmt, FORMATS, "fmt")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES.values():
        raise ValueError(f"quantize: x must be a high-precision floating tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    scale_shape = _scale_shape(tuple(x.shape), granularity)  # validates the rank
    xf = x.detach().to(torch.float32)
    fp8_max = FP8_MAX[fmt]

    def absmax(v: torch.Tensor, dim) -> torch.Tensor:
        # max(amax, -amin): two fast reductions and no |x| temporary; both propagate nan, and inf shows up as inf
        return torch.maximum(v.amax(dim=dim), v.amin(dim=dim).neg())

    # Groups are views of (zero-padded) x: zeros change no amax and are cropped after the division.
    if xf.numel() == 0:
        amax, view = xf.new_zeros(scale_shape), None
    elif granularity == "tensorwise":
        view = xf
        amax = absmax(view, None)
    elif granularity == "rowwise":
        view = xf
        amax = absmax(view, -1).unsqueeze(-1)
    elif granularity == "group128":
        xp = _pad_to(xf, -1, GROUP)
        view = xp.reshape(*xp.shape[:-1], xp.shape[-1] // GROUP, GROUP)
        amax = absmax(view, -1)
    else:
        xp = _pad_to(_pad_to(xf, -1, GROUP), -2, GROUP)
        mb, kb = xp.shape[-2] // GROUP, xp.shape[-1] // GROUP
        view = xp.reshape(*xp.shape[:-2], mb, GROUP, kb, GROUP)
        amax = absmax(view, (-3, -1))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quantize: input contains non-finite values (inf or nan, or beyond the FP32 range); "
                         "FP8 scales cannot be computed from them")
    scale = torch.clamp(amax / fp8_max, min=MIN_SCALE)
    if pow2:
        scale = _round_up_pow2(scale)
    assert tuple(scale.shape) == scale_shape
    if view is None:
        scaled = xf
    elif granularity in ("tensorwise", "rowwise"):
        scaled = view / scale
    elif granularity == "group128":
        scaled = (view / scale.unsqueeze(-1)).reshape(xp.shape)[..., : xf.shape[-1]]
    else:
        scaled = (view / scale.unsqueeze(-1).unsqueeze(-3)).reshape(xp.shape)[..., : xf.shape[-2], : xf.shape[-1]]
    data = scaled.clamp_(-fp8_max, fp8_max).to(FP8_DTYPES[fmt])
    return QuantizedTensor(data, scale.contiguous(), granularity, fmt)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` computed in FP32 (each FP8 value times its group's scale), then cast to ``dtype``."""
    data = q.data.to(torch.float32)
    shape = data.shape
    if q.granularity == "group128" and shape[-1] % GROUP == 0:  # same values, no expanded scale tensor
        out = data.reshape(*shape[:-1], shape[-1] // GROUP, GROUP).mul_(q.scale.unsqueeze(-1)).reshape(shape)
    elif q.granularity == "block128" and shape[-1] % GROUP == 0 and shape[-2] % GROUP == 0:
        mb, kb = shape[-2] // GROUP, shape[-1] // GROUP
        blocks = data.reshape(*shape[:-2], mb, GROUP, kb, GROUP)
        out = blocks.mul_(q.scale.unsqueeze(-1).unsqueeze(-3)).reshape(shape)
    else:
        out = data.mul_(q.expanded_scale())
    return out.to(dtype)
