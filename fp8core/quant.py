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
group32        ``[M, ceil(K/32)]``                1x32 slices of the last dim (MXFP8's blocks, every operand)
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

from fp8core.formats import (
    E4M3_MAX,
    E5M2_MAX,
    FORMATS,
    FP8_DTYPES,
    FP8_MAX,
    GRANULARITIES,
    GROUP,
    GROUP_SIZES,
    MIN_SCALE,
    NON_FINITE,
    NonFiniteInput,
    amax_groups,
    scale_from_amax,
)
from fp8core.quant_chunked import _columns, _fp8_to_fp32, _quantize_2d, _SingleThread

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FORMATS",
    "FP8_DTYPES",
    "FP8_MAX",
    "GRANULARITIES",
    "MIN_SCALE",
    "NON_FINITE",
    "NonFiniteInput",
    "QuantizedTensor",
    "dequantize",
    "expand_scale",
    "nonfinite_seen",
    "record_nonfinite",
    "quantize",
    "quantize_dequantize",
    "quantize_columns",
    "quantize_dequantize_columns",
    "quantize_on_device",
    "quantize_reference",
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
    if granularity in GROUP_SIZES:
        return (*shape[:-1], math.ceil(shape[-1] / GROUP_SIZES[granularity]))
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


def expand_scale(scale: torch.Tensor, granularity: str, shape) -> torch.Tensor:
    """Broadcast a ``granularity`` scale tensor to a data tensor of ``shape`` (partial groups cropped)."""
    _check_choice(granularity, GRANULARITIES, "granularity")
    shape = tuple(shape)
    if granularity in ("tensorwise", "rowwise"):
        return scale.expand(shape)
    if granularity in GROUP_SIZES:
        return scale.repeat_interleave(GROUP_SIZES[granularity], dim=-1)[..., : shape[-1]]
    return scale.repeat_interleave(GROUP, dim=-2).repeat_interleave(GROUP, dim=-1)[..., : shape[-2], : shape[-1]]


def _check_input(x, granularity: str, fmt: str) -> None:
    _check_choice(granularity, GRANULARITIES, "granularity")
    _check_choice(fmt, FORMATS, "fmt")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES.values():
        raise ValueError(f"quantize: x must be a high-precision floating tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")



def quantize_reference(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """The plain whole-tensor implementation of :func:`quantize` (the specification the fast path is tested
    against bit for bit): FP32 copy, zero-padded group views, one division, clamp, cast."""
    _check_input(x, granularity, fmt)
    q, amax = _quantize_whole(x, granularity, fmt, pow2)
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteInput(NON_FINITE)
    return q


def _quantize_whole(x: torch.Tensor, granularity: str, fmt: str, pow2: bool) -> tuple[QuantizedTensor, torch.Tensor]:
    """quantize_reference's arithmetic without its finiteness check: (the quantized tensor, the groups' amax). Only
    tensor operations: no value is read back to the host."""
    scale_shape = _scale_shape(tuple(x.shape), granularity)  # validates the rank
    xf = x.detach().to(torch.float32)
    fp8_max = FP8_MAX[fmt]
    # Groups are views of (zero-padded) x: zeros change no amax and are cropped after the division.
    if xf.numel() == 0:
        amax, view = xf.new_zeros(scale_shape), None
    elif granularity == "tensorwise":
        view = xf
        amax = amax_groups(view, None)
    elif granularity == "rowwise":
        view = xf
        amax = amax_groups(view, -1).unsqueeze(-1)
    elif granularity in GROUP_SIZES:
        g = GROUP_SIZES[granularity]
        xp = _pad_to(xf, -1, g)
        view = xp.reshape(*xp.shape[:-1], xp.shape[-1] // g, g)
        amax = amax_groups(view, -1)
    else:
        xp = _pad_to(_pad_to(xf, -1, GROUP), -2, GROUP)
        mb, kb = xp.shape[-2] // GROUP, xp.shape[-1] // GROUP
        view = xp.reshape(*xp.shape[:-2], mb, GROUP, kb, GROUP)
        amax = amax_groups(view, (-3, -1))
    scale = scale_from_amax(amax, fp8_max, pow2)
    assert tuple(scale.shape) == scale_shape
    if view is None:
        scaled = xf
    elif granularity in ("tensorwise", "rowwise"):
        scaled = view / scale
    elif granularity in GROUP_SIZES:
        scaled = (view / scale.unsqueeze(-1)).reshape(xp.shape)[..., : xf.shape[-1]]
    else:
        scaled = (view / scale.unsqueeze(-1).unsqueeze(-3)).reshape(xp.shape)[..., : xf.shape[-2], : xf.shape[-1]]
    data = scaled.clamp_(-fp8_max, fp8_max).to(FP8_DTYPES[fmt])
    return QuantizedTensor(data, scale.contiguous(), granularity, fmt), amax


# ------------------------------------------------------------------------------------------ off the CPU
# On a GPU (any device but the CPU) quantize runs the reference's whole-tensor arithmetic: a few vectorized kernels
# and no host synchronization (the CPU paths are tuned for caches and read the amax back to check it). A non-finite
# check that raises would have to read the device, so there a group with a non-finite value gets a non-finite scale
# and the bad value a NaN code (whatever the GEMM makes of them is NaN), and a flag on the device records it with
# device operations only; :func:`nonfinite_seen` reads and clears it where the caller synchronizes anyway (the
# trainer: its finite-loss check) and the caller raises NON_FINITE, as quantize raises at once on a CPU.
_NONFINITE: dict[torch.device, torch.Tensor] = {}


def quantize_on_device(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """What :func:`quantize` runs off the CPU, on any device (the tests run it on CPU tensors and on the meta device,
    where a host read fails): the codes and scales of :func:`quantize` bit for bit for finite input, no host
    synchronization; non-finite input sets the device's flag (:func:`nonfinite_seen`) instead of raising."""
    _check_input(x, granularity, fmt)
    q, amax = _quantize_whole(x, granularity, fmt, pow2)
    record_nonfinite(amax.device, torch.isfinite(amax).all().logical_not())
    return q


def record_nonfinite(device: torch.device | str, seen: torch.Tensor | bool = True) -> None:
    """Set ``device``'s non-finite flag where ``seen`` (a bool tensor on the device: no synchronization)."""
    device = torch.device(device)
    flag = _NONFINITE.get(device)
    if flag is None:
        with torch.inference_mode(False):  # a normal tensor, so that it can be cleared outside inference mode
            flag = _NONFINITE[device] = torch.zeros((), dtype=torch.bool, device=device)
    flag.logical_or_(torch.as_tensor(seen, device=device))


def nonfinite_seen(device: torch.device | str) -> bool:
    """Whether non-finite input was recorded on ``device`` since the last call (by :func:`quantize_on_device`, or a
    caller's :func:`record_nonfinite`), and clear the flag.
    Reads the device (a synchronization): call it where the caller synchronizes anyway. False on the meta device."""
    device = torch.device(device)
    flag = _NONFINITE.get(device)
    if flag is None or device.type == "meta":
        return False
    seen = bool(flag)
    flag.zero_()
    return seen


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` computed in FP32 (each FP8 value times its group's scale), then cast to ``dtype``."""
    data = _fp8_to_fp32(q.data)
    shape = data.shape
    g = GROUP_SIZES.get(q.granularity)
    if g is not None and shape[-1] % g == 0:  # same values, no expanded scale tensor
        out = data.reshape(*shape[:-1], shape[-1] // g, g).mul_(q.scale.unsqueeze(-1)).reshape(shape)
    elif q.granularity == "block128" and shape[-1] % GROUP == 0 and shape[-2] % GROUP == 0:
        mb, kb = shape[-2] // GROUP, shape[-1] // GROUP
        blocks = data.reshape(*shape[:-2], mb, GROUP, kb, GROUP)
        out = blocks.mul_(q.scale.unsqueeze(-1).unsqueeze(-3)).reshape(shape)
    else:
        out = data.mul_(q.expanded_scale())
    return out.to(dtype)


def _as_2d(x: torch.Tensor, granularity: str) -> torch.Tensor | None:
    """The 2-D view the fast path works on, or None where the reference handles it (empty, 0-d, batched block128)."""
    if x.numel() == 0 or x.dim() == 0 or (granularity == "block128" and x.dim() != 2):
        return None
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1])


def quantize(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """Quantize ``x`` to FP8 with one FP32 dequantization scale per group (module docstring).

    ``scale = amax / fp8_max`` (``2**ceil(log2(.))`` if ``pow2``), floored at 2**-126;
    ``data = fp8(clamp(x / scale, +-fp8_max))`` with torch's round-to-nearest-even cast.
    Source of the convention: DeepSeek-V3 / vLLM block FP8 (``weight_scale_inv``), torchao float8 (reciprocal form).
    Bit-identical to :func:`quantize_reference`: computed by the fused C++ kernel (fp8core.kernels) where it is in
    use, else in cache-sized row chunks of torch ops.
    """
    _check_input(x, granularity, fmt)
    if x.device.type != "cpu":
        return quantize_on_device(x, granularity, fmt=fmt, pow2=pow2)
    scale_shape = _scale_shape(tuple(x.shape), granularity)
    x2 = _as_2d(x.detach(), granularity)
    if x2 is None:
        return quantize_reference(x, granularity, fmt=fmt, pow2=pow2)
    fused = _fused(x2, _tile(granularity, x2.shape), fmt=fmt, pow2=pow2, want_dq=False, want_data=True)
    if fused is not None:
        return QuantizedTensor(fused[1].reshape(x.shape), fused[2].reshape(scale_shape), granularity, fmt)
    with _SingleThread():
        data, scale, _ = _quantize_2d(x2, granularity, fmt, pow2, want_data=True, want_dq=False)
    return QuantizedTensor(data.reshape(x.shape), scale.reshape(scale_shape), granularity, fmt)


def quantize_dequantize(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3", pow2: bool = False,
                        keep_data: bool = False) -> tuple[torch.Tensor, QuantizedTensor | None]:
    """``dequantize(quantize(x, ...))`` in one chunked pass, bit for bit (the FP32 values an emulated FP8 GEMM
    multiplies), plus the QuantizedTensor when ``keep_data``. x's shape is kept; the result is FP32 and contiguous."""
    _check_input(x, granularity, fmt)
    if x.device.type != "cpu":
        q = quantize_on_device(x, granularity, fmt=fmt, pow2=pow2)
        return dequantize(q), (q if keep_data else None)
    scale_shape = _scale_shape(tuple(x.shape), granularity)
    x2 = _as_2d(x.detach(), granularity)
    if x2 is None:
        q = quantize_reference(x, granularity, fmt=fmt, pow2=pow2)
        return dequantize(q), (q if keep_data else None)
    fused = _fused(x2, _tile(granularity, x2.shape), fmt=fmt, pow2=pow2, want_dq=True, want_data=keep_data)
    if fused is not None:
        dq, data, scale = fused
        q = QuantizedTensor(data.reshape(x.shape), scale.reshape(scale_shape), granularity, fmt) if keep_data else None
        return dq.reshape(x.shape), q
    with _SingleThread():
        data, scale, dq = _quantize_2d(x2, granularity, fmt, pow2, want_data=keep_data, want_dq=True)
    q = QuantizedTensor(data.reshape(x.shape), scale.reshape(scale_shape), granularity, fmt) if keep_data else None
    return dq.reshape(x.shape), q


def quantize_dequantize_columns(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3",
                                pow2: bool = False) -> torch.Tensor:
    """``quantize_dequantize(x.t(), granularity)`` returned transposed back, i.e. 2-D ``x [T, K]`` quantized along
    its *first* dim (groups of 128 rows per column for group128, whole columns for rowwise), bit for bit, without
    materializing ``x.t()``: the wgrad GEMM contracts over tokens, and reading ``x`` row-major is ~10x faster than
    gathering its columns. Result: FP32 ``[T, K]``, contiguous."""
    _check_input(x, granularity, fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize_dequantize_columns: x must be 2-D, got shape {tuple(x.shape)}")
    if granularity == "block128":
        raise ValueError("quantize_dequantize_columns: block128 is transpose-symmetric; use quantize_dequantize")
    x = x.detach()
    if granularity == "tensorwise" or x.numel() == 0:  # elementwise with one scale: transposing commutes
        return quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2)[0]
    if x.device.type != "cpu":
        return dequantize(quantize_on_device(x.t(), granularity, fmt=fmt, pow2=pow2)).t().contiguous()
    fused = _fused(x, _column_tile(granularity, x.shape[0]), fmt=fmt, pow2=pow2, want_dq=True, want_data=False)
    if fused is not None:
        return fused[0]
    with _SingleThread():
        return _columns(x, granularity, fmt, pow2)


def quantize_columns(x: torch.Tensor, granularity: str, *, fmt: str = "e4m3", pow2: bool = False) -> QuantizedTensor:
    """``quantize(x.t(), granularity)`` for 2-D ``x [T, K]``, bit for bit, computed in ``x``'s own layout: the codes
    as the transposed view ``[K, T]`` of a ``[T, K]`` tensor (the CPU FP8 GEMM reads any strides), the scales as
    ``quantize(x.t())`` has them. The wgrad GEMM's operands are quantized along tokens; gathering ``x``'s columns
    into a contiguous ``x.t()`` first costs more than the quantization itself. Where the fused kernel is not in use,
    ``quantize(x.t().contiguous())``."""
    _check_input(x, granularity, fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize_columns: x must be 2-D, got shape {tuple(x.shape)}")
    x = x.detach()
    if x.numel() == 0 or x.device.type != "cpu":  # off the CPU: the whole-tensor path reads the view as it is
        return quantize(x.t(), granularity, fmt=fmt, pow2=pow2)
    if granularity in ("tensorwise", "block128"):  # transpose-symmetric groupings
        return quantize(x, granularity, fmt=fmt, pow2=pow2).t()
    fused = _fused(x, _column_tile(granularity, x.shape[0]), fmt=fmt, pow2=pow2, want_dq=False, want_data=True)
    if fused is None:
        return quantize(x.t().contiguous(), granularity, fmt=fmt, pow2=pow2)
    _, data, scale = fused  # data [T, K]; scale [groups along T, K]
    return QuantizedTensor(data.t(), scale.t().contiguous(), granularity, fmt)


def _column_tile(granularity: str, t: int) -> tuple[int, int]:
    """The group of ``granularity`` along the first dim of a 2-D ``[T, K]`` tensor (group128 / rowwise of its
    transpose) as a tile of (rows, cols) elements."""
    return (GROUP_SIZES.get(granularity, t), 1)


def _tile(granularity: str, shape2d) -> tuple[int, int]:
    """The group of ``granularity`` on a 2-D ``[M, K]`` tensor as a tile of (rows, cols) elements."""
    m, k = shape2d
    if granularity in GROUP_SIZES:
        return (1, GROUP_SIZES[granularity])
    return {"tensorwise": (max(m, 1), max(k, 1)), "rowwise": (1, max(k, 1)), "block128": (GROUP, GROUP)}[granularity]


def _fused(x2: torch.Tensor, tile: tuple[int, int], *, fmt: str, pow2: bool, want_dq: bool, want_data: bool):
    """``(dq or None, data or None, scale)`` from the fused C++ kernel (fp8core.kernels: one pass per group, the same
    IEEE operations as the chunked torch path below, bit-identical), or None where it is not in use."""
    from fp8core import kernels

    res = kernels.quantize_tiles(x2, tile=tile, fmt=fmt, pow2=pow2, want_dq=want_dq, want_codes=want_data)
    if res is None:
        return None
    dq, data, amax, scale = res
    if amax.numel() and not math.isfinite(float(amax.max())):  # amax >= 0; nan/inf patterns compare above finite
        raise NonFiniteInput(NON_FINITE)
    return dq, data, scale
