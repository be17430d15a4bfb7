"""Quantizing a weight that no process holds whole: each holder of a block of its rows (a data-parallel rank's
dim-0 shard) gets the codes of its rows and the whole tensor's scales, bit for bit what :func:`fp8core.quant.quantize`
gives the whole weight.

A scale group may straddle two holders: a 128x128 block when the shard boundary is not a multiple of 128 rows, the
one group of a tensorwise scale always. So quantization takes two steps with a reduction in between:

1. :func:`shard_amax` -- the group amax of this holder's rows, laid out on the *whole* tensor's scale grid (groups
   this holder does not touch are 0);
2. the caller combines every holder's amax by elementwise maximum (``all_reduce(MAX)`` over the data-parallel
   group; nothing with one holder); zeros change no maximum, so the result is the whole tensor's amax, exactly;
3. :func:`quantize_shard` -- the scales from that amax (the quantizer's rule, fp8core.formats.scale_from_amax)
   and this holder's codes.

Every step is the quantizer's own FP32 arithmetic on the same values (the division by the same scale, the same
clamp and cast), so the codes and scales are the whole tensor's, whatever the row split (tested against quantize
on split points inside and on block boundaries, empty shards, every granularity, pow2). A non-finite value gives a
non-finite amax (inf, also for NaN); the caller checks the reduced amax (:func:`fp8core.quant.quantize` would
raise).
"""
from __future__ import annotations

import math

import torch

from .formats import FP8_DTYPES, FP8_MAX, GRANULARITIES, GROUP, GROUP_SIZES, amax_groups, scale_from_amax
from .quant import expand_scale

__all__ = ["shard_amax", "quantize_shard"]


def _check(x: torch.Tensor, granularity: str, row_offset: int, rows: int) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not supported; allowed: {', '.join(GRANULARITIES)}")
    if x.dim() != 2:
        raise ValueError(f"a weight shard must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if not 0 <= row_offset <= rows - x.shape[0]:
        raise ValueError(f"shard rows [{row_offset}, {row_offset + x.shape[0]}) are not inside the weight's {rows} rows")


def _absmax(v: torch.Tensor, dim) -> torch.Tensor:
    # the quantizer's amax, except that NaN becomes inf: a maximum over holders keeps inf, where a reduction such as
    # gloo's MAX may drop a NaN (max(a, NaN) = a)
    return amax_groups(v, dim).nan_to_num(nan=float("inf"))


def shard_amax(x: torch.Tensor, granularity: str, *, row_offset: int, rows: int) -> torch.Tensor:
    """The amax of the scale groups of ``x`` -- rows ``[row_offset, row_offset + len(x))`` of a 2-D weight of
    ``rows`` rows -- on the whole weight's scale grid (FP32, the shape of the whole tensor's scale; 0 where this
    shard has no element of a group)."""
    _check(x, granularity, row_offset, rows)
    n, k = x.shape
    xf = x.detach().to(torch.float32)
    if granularity == "tensorwise":
        return _absmax(xf, None) if n and k else xf.new_zeros(())
    if granularity == "rowwise" or granularity in GROUP_SIZES:
        g = GROUP_SIZES.get(granularity, k)
        ncols = 1 if granularity == "rowwise" else math.ceil(k / g)
        out = xf.new_zeros(rows, ncols)
        if n and k:
            if granularity == "rowwise":
                local = _absmax(xf, -1).unsqueeze(-1)
            else:
                xp = torch.nn.functional.pad(xf, (0, ncols * g - k))
                local = _absmax(xp.view(n, ncols, g), -1)
            out[row_offset:row_offset + n] = local
        return out
    kb = math.ceil(k / GROUP)
    out = xf.new_zeros(math.ceil(rows / GROUP), kb)
    if n and k:
        top = row_offset % GROUP  # zero rows above the shard align it with the whole tensor's block rows
        nb = math.ceil((top + n) / GROUP)
        xp = torch.nn.functional.pad(xf, (0, kb * GROUP - k, top, nb * GROUP - top - n))
        first = row_offset // GROUP
        out[first:first + nb] = _absmax(xp.view(nb, GROUP, kb, GROUP), (1, 3))
    return out


def quantize_shard(x: torch.Tensor, amax: torch.Tensor, granularity: str, *, row_offset: int, rows: int,
                   fmt: str = "e4m3", pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes of ``x``'s rows, the whole weight's scale) from the whole weight's ``amax`` (every shard's
    :func:`shard_amax` combined by maximum): rows ``[row_offset, row_offset + len(x))`` of ``quantize(weight)``'s
    data, and its scale."""
    _check(x, granularity, row_offset, rows)
    scale = scale_from_amax(amax, FP8_MAX[fmt], pow2)
    n, k = x.shape
    xf = x.detach().to(torch.float32)
    if granularity == "tensorwise":
        s = scale
    else:
        # the whole tensor's scale, expanded over this shard's rows only (block rows / rows above it cropped)
        if granularity == "block128":
            first = row_offset // GROUP
            last = math.ceil((row_offset + n) / GROUP) if n else first
            top = row_offset - first * GROUP
            s = expand_scale(scale[first:last], "block128", ((last - first) * GROUP, k))[top:top + n]
        else:
            s = expand_scale(scale[row_offset:row_offset + n], granularity, (n, k))
    data = (xf / s).clamp_(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPES[fmt])
    return data, scale.contiguous()
