"""A trainer rank's side of a refit over the refit wire (process.refit_wire): what it serves from the shard it
holds, one bucket (decoder layer) at a time, without gathering the model.

Each state entry of the (possibly FSDP2-sharded) model is served from this rank's dim-0 chunk of it (FSDP2 shards
every parameter along dim 0 like ``torch.chunk``; one worker holds everything):

* an FP8 linear's weight (end-to-end FP8: the engine runs this trainer's numerics) -- the codes of this rank's rows;
  the scales are the whole weight's, from the group amax of every rank's rows combined by an all-reduce(MAX) over
  the data-parallel group (fp8core.shard: a 128x128 block that straddles two ranks' rows gets one scale, a
  tensorwise scale is global), sent by rank 0 alone. Codes and scales equal ``quantize`` of the whole weight;
* fused MoE experts -- each expert this rank holds whole, under its checkpoint names, quantized here (FP8Experts);
* everything else -- this rank's rows in BF16 (MoE routers in FP32).

Without end-to-end FP8 every entry goes as FP32 rows (the masters an FP8-generation engine quantizes itself). All
amax all-reduces run once, before the manifest (so a non-finite weight refuses the refit on every member before any
payload moves), over tensors of the scale's size only.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fp8core.linear import WEIGHT_GRANULARITY, WeightCache
from fp8core.moe import checkpoint_state_dict
from fp8core.quant import _scale_shape
from fp8core.serve import SCALE_SUFFIX, served_recipes, served_scale, served_scale_dtype
from fp8core.shard import quantize_shard, shard_amax
from process.refit_wire import Piece

__all__ = ["ServedShard", "bucket_of"]

_LAYER = "model.layers."


def bucket_of(name: str, num_layers: int, others: dict[str, int]) -> int:
    """The bucket of a served name: its decoder layer, else one bucket per other state entry (embeddings, final
    norm, lm_head: each can be larger than a decoder layer), numbered after the layers in ``others``' order."""
    if name.startswith(_LAYER):
        return int(name[len(_LAYER):].split(".", 1)[0])
    return num_layers + others[name]


def _local(t: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a state entry, the first row's index): a DTensor's local chunk, or the whole tensor."""
    if not hasattr(t, "to_local"):
        return t, 0
    local = t.to_local()
    if t.dim() == 0:
        return local, 0
    chunk = math.ceil(t.shape[0] / world)
    start = min(t.shape[0], rank * chunk)
    if local.shape[0] != min(t.shape[0], start + chunk) - start:
        raise ValueError(f"refit: a shard of {tuple(t.shape)} has {local.shape[0]} rows on rank {rank} of {world}; "
                         "expected torch.chunk's")
    return local, start


class ServedShard:
    """What this rank serves at a refit: ``manifest`` (buckets of pieces), ``tensors(b)`` (bucket ``b``'s tensors,
    in the manifest's order) and ``error`` (a non-finite weight, named; None when servable)."""

    def __init__(self, model: torch.nn.Module, *, fp8: bool, rank: int = 0, world: int = 1,
                 all_reduce_max: Callable[[torch.Tensor], None] | None = None):
        self.rank, self.world, self.fp8 = rank, world, fp8
        recipes, fp32 = served_recipes(model) if fp8 else ({}, set())
        layers = getattr(getattr(model, "model", None), "layers", ())
        self._layers = len(layers)
        state = model.state_dict()
        self._others = {n: i for i, n in enumerate(n for n in state if not n.startswith(_LAYER))}
        self.num_buckets = len(layers) + len(self._others)
        self._jobs: list[list[tuple]] = [[] for _ in range(self.num_buckets)]
        self.manifest: list[list[Piece]] = [[] for _ in range(self.num_buckets)]
        sharded: list[tuple[str, torch.Tensor, int, int, str, object]] = []
        self.error: str | None = None
        for entry, t in state.items():
            is_shard = hasattr(t, "to_local") and t.dim() > 0 and world > 1
            if not is_shard and rank != 0:
                continue  # a tensor every rank holds whole (not sharded): rank 0 serves it
            local, start = _local(t, rank, world)
            split = checkpoint_state_dict({entry: local})
            if entry not in split:  # fused experts: the experts this rank holds, whole, renumbered globally
                for name, view in _renumber(split, start).items():
                    self._whole(name, view, recipes.get(name), fp32)
            elif not is_shard:
                self._whole(entry, local, recipes.get(entry), fp32)
            elif (config := recipes.get(entry)) is None or local.dim() != 2:  # this rank's rows, high precision
                self._check_finite(entry, local)
                hp = torch.float32 if (not fp8 or entry in fp32) else torch.bfloat16
                self._add(entry, ("hp", local, hp), Piece(entry, _dt(hp), tuple(local.shape), start, t.shape[0]))
            else:
                sharded.append((entry, local, start, t.shape[0], WEIGHT_GRANULARITY[config.recipe], config))
        whole_amax = self._reduce_amax(sharded, all_reduce_max)
        for name, local, start, rows, gran, config in sharded:
            amax = whole_amax[name]
            if self.error is None and not bool(torch.isfinite(amax).all()):
                self.error = f"refit: {name} has non-finite values (its FP8 amax over the data-parallel ranks)"
            self._add(name, ("shard", name, local, amax, gran, start, rows, config.pow2_weight),
                      Piece(name, "uint8", tuple(local.shape), start, rows))
            if rank == 0:  # the whole weight's scale, the same on every rank
                self._add_scale(name, _scale_shape((rows, local.shape[1]), gran), gran)

    def _bucket(self, name: str) -> int:
        return bucket_of(name, self._layers, self._others)

    def _add(self, name: str, job: tuple, piece: Piece) -> None:
        b = self._bucket(name)
        self._jobs[b].append(job)
        self.manifest[b].append(piece)

    def _add_scale(self, name: str, shape, granularity: str) -> None:
        """The scale of FP8 weight ``name`` (in its served dtype: E8M0 for 1x32 groups, else FP32), in its weight's
        bucket right after the codes that compute it."""
        b = self._bucket(name)
        self._jobs[b].append(("scale_of", name, tuple(shape), granularity))
        self.manifest[b].append(Piece(name + SCALE_SUFFIX, _dt(served_scale_dtype(granularity)), tuple(shape)))

    def _check_finite(self, name: str, t: torch.Tensor) -> None:
        if self.error is None and not bool(torch.isfinite(t).all()):
            self.error = f"refit: {name} has non-finite values (trainer rank {self.rank})"

    def _whole(self, name: str, t: torch.Tensor, config, fp32: set[str]) -> None:
        """A tensor this rank holds whole: an FP8 weight as codes + scale (quantize), else high precision."""
        self._check_finite(name, t)  # for an FP8 weight: quantize would raise later, after the verdict round
        if config is None:
            hp = torch.float32 if (not self.fp8 or name in fp32) else torch.bfloat16
            self._add(name, ("hp", t, hp), Piece(name, _dt(hp), tuple(t.shape)))
            return
        self._add(name, ("whole_fp8", name, t, config), Piece(name, "uint8", tuple(t.shape)))
        gran = WEIGHT_GRANULARITY[config.recipe]
        self._add_scale(name, _scale_shape(tuple(t.shape), gran), gran)

    def _reduce_amax(self, sharded, all_reduce_max) -> dict[str, torch.Tensor]:
        """Every sharded FP8 weight's whole amax: this rank's on the whole scale grid, all of them in one
        all-reduce(MAX) over the data-parallel group."""
        if not sharded:
            return {}
        parts = [shard_amax(local, gran, row_offset=start, rows=rows) for _, local, start, rows, gran, _ in sharded]
        flat = torch.cat([p.reshape(-1) for p in parts])
        if all_reduce_max is not None:
            all_reduce_max(flat)
        out, at = {}, 0
        for (name, *_), p in zip(sharded, parts, strict=True):
            out[name] = flat[at:at + p.numel()].view(p.shape)
            at += p.numel()
        return out

    def tensors(self, b: int) -> list[torch.Tensor]:
        """Bucket ``b``'s tensors, quantized now, in the manifest's order."""
        out: list[torch.Tensor] = []
        scales: dict[str, torch.Tensor] = {}  # of the FP8 weights quantized so far in this bucket
        for job in self._jobs[b]:
            kind = job[0]
            if kind == "hp":
                out.append(job[1].detach().to(job[2]))
            elif kind == "whole_fp8":
                _, name, weight, config = job
                q = WeightCache().get(weight, config)[0]
                out.append(q.data.view(torch.uint8))
                scales[name] = q.scale
            elif kind == "shard":
                _, name, local, amax, gran, start, rows, pow2 = job
                codes, scales[name] = quantize_shard(local, amax, gran, row_offset=start, rows=rows, pow2=pow2)
                out.append(codes.view(torch.uint8))
            else:  # "scale_of": the scale of the FP8 weight named, computed just before it
                _, name, shape, gran = job
                out.append(served_scale(scales[name].reshape(shape).float(), gran))
        return out


def _renumber(split: dict[str, torch.Tensor], first: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names numbered from 0 (a local chunk of experts) renumbered from ``first``."""
    if not first:
        return split
    out = {}
    for name, t in split.items():
        head, tail = name.split(".experts.", 1)
        e, rest = tail.split(".", 1)
        out[f"{head}.experts.{int(e) + first}.{rest}"] = t
    return out


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
