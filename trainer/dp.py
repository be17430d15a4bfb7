"""Data-parallel trainers: ``cluster.policy_workers`` PolicyWorkers as ranks of one ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU), the model sharded with torch's FSDP2 ``fully_shard`` (per decoder layer, then the
root): each rank holds 1/M of the FP32 masters, of the gradients and of the AdamW state.

How the trainer uses it (trainer/policy.py):

* Training: every rank gets the whole step's batch (one object in Ray's object store) and trains on a contiguous
  share of each optimizer update's rows. The loss normalizer (tokens or sequences of the *global* update) is known on
  every rank from the whole batch, so no collective is needed for it. The update's micro-batches run inside
  :func:`local_accumulation`: parameters all-gathered once, gradients accumulated unsharded with no communication
  (ranks may run different numbers of micro-batches, or none), then its ``reduce`` runs one zero-weighted
  forward/backward with gradient sync on, which reduce-scatters the accumulated gradients (summed, not averaged:
  the loss is already normalized globally). With ``M`` dividing the update's rows and the micro-batch size dividing
  each share, rank ``r``'s micro-batches are exactly micro-batches of the single-worker run, so FP8 rounding (whose
  1x128 groups along tokens depend on which rows share a micro-batch) is the same and only the order of the gradient
  sum differs.
* No-grad passes (old logprobs, Calibrated Clipping's FP8 and BF16-shadow passes, KV-scale calibration): inside
  :func:`unsharded` each rank computes its share of the rows with no collective per forward; :func:`all_sum` of
  zero-filled tensors assembles the full result on every rank (every rank then computes the same metrics and the
  same clip bounds).
* Refit and checkpoints: full weights (and full optimizer state) gathered to rank 0, which alone ships / writes
  them; the other ranks return nothing. A checkpoint has the single-worker layout, so a run resumes with any M.

Every collective has the group's timeout (``cluster.collective_timeout_s``, default 60 s): a dead rank fails the
step within it instead of gloo's 30-minute default.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DPGroup", "free_endpoint", "init_group", "shard_model", "fsdp_modules", "unsharded",
           "local_accumulation", "all_sum", "all_min", "gather_objects", "full_tensor", "longest_first_batches",
           "share_batches", "clip_grad_norm"]


@dataclass(frozen=True)
class DPGroup:
    """This worker's place in the data-parallel group (``world == 1``: no group, everything local)."""

    rank: int = 0
    world: int = 1
    init_method: str | None = None  # tcp://host:port of rank 0's rendezvous
    timeout_s: float = 60.0

    @property
    def active(self) -> bool:
        return self.world > 1

    def share(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of ``rows`` (sizes differ by at most one, larger ones first)."""
        return torch.tensor_split(rows, self.world)[self.rank] if self.active else rows


def free_endpoint() -> str:
    """``tcp://<this node's address>:<a free port>``: the rendezvous of a group whose rank 0 runs on this node."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def init_group(group: DPGroup, device: torch.device) -> None:
    """Join the process group (blocks until all ``world`` ranks joined or the timeout passed)."""
    import torch.distributed as dist

    if not group.active or dist.is_initialized():
        return
    if not group.init_method:
        raise ValueError(f"data-parallel rank {group.rank} of {group.world}: no rendezvous address (init_method)")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=group.init_method,
                            rank=group.rank, world_size=group.world,
                            timeout=datetime.timedelta(seconds=group.timeout_s))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers``), the unit FSDP2 shards and gathers."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers to shard (data-parallel trainers need an HF "
                         "decoder-only model)")
    return list(layers)


def shard_model(model: nn.Module, device: torch.device) -> None:
    """FSDP2 over the group: each decoder layer, then the root (embeddings, final norm, lm_head). Gradients are
    summed over ranks, not averaged (the loss is normalized by the global token count)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # a plain sum (with ReduceOp.SUM: gloo has no PREMUL_SUM)
        m.set_force_sum_reduction_for_comms(True)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(model: nn.Module, group: DPGroup) -> Iterator[None]:
    """Full parameters on every rank for the duration (one all-gather per FSDP unit on entry, free on exit): the
    forwards inside run no collective, so ranks may run different numbers of them. A no-op without a group."""
    if not group.active:
        yield
        return
    mods = fsdp_modules(model)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # FSDP2's defaults: the root keeps its own
        for m in model.modules():  # FP8 linears' quantized copies of the full weights: freed with them
            cache = getattr(m, "weight_cache", None)
            if cache is not None:
                cache.clear()
        # other caches of rounded full weights (the BF16 emulation's, keyed by pointer + version): the next
        # all-gather refills the same storage without bumping the version, so a stale copy would be reused
        for cache in getattr(model, "reshard_caches", ()):
            cache.clear()


@contextlib.contextmanager
def local_accumulation(model: nn.Module, group: DPGroup) -> Iterator[object]:
    """Micro-batches of one update with no communication: parameters stay gathered, gradients accumulate unsharded
    (FSDP2's no-sync accumulation). Yields ``reduce(forward_zero)``, which every rank must call exactly once at the
    end of the update: it reduce-scatters the accumulated gradients (summed over ranks) by one forward / backward of
    ``forward_zero()`` -- a scalar that is 0 times a full forward of the model, so every unit's gradient hooks fire,
    now with sync on, and add zeros to what was accumulated. Without a group ``reduce`` does nothing."""
    if not group.active:
        yield lambda forward_zero: None
        return
    mods = fsdp_modules(model)

    def sync(on: bool) -> None:
        for m in mods:
            m.set_requires_gradient_sync(on, recurse=False)

    def reduce(forward_zero) -> None:
        sync(True)
        forward_zero().backward()

    for m in mods:
        m.set_reshard_after_backward(False, recurse=False)
    sync(False)
    with unsharded(model, group):
        try:
            yield reduce
        finally:
            sync(True)
            for m in mods:
                m.set_reshard_after_backward(True, recurse=False)


def all_sum(*tensors: torch.Tensor, group: DPGroup) -> None:
    """In-place sum over ranks (zero-filled shares -> the whole on every rank)."""
    if not group.active:
        return
    import torch.distributed as dist

    for t in tensors:
        if t.dtype == torch.bool:
            raise TypeError("all_sum of a bool tensor: convert to a number type first")
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def all_min(value: float, group: DPGroup) -> float:
    if not group.active:
        return value
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t)


def gather_objects(obj, group: DPGroup) -> list:
    """Every rank's ``obj`` in rank order, on every rank (small things: metrics, amax samples)."""
    if not group.active:
        return [obj]
    import torch.distributed as dist

    out = [None] * group.world
    dist.all_gather_object(out, obj)
    return out


def longest_first_batches(lengths: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """The no-grad passes' batching rule (PolicyWorker._local_logprobs): positions sorted by length, descending and
    stable, in chunks of ``batch_size``."""
    order = torch.argsort(lengths, descending=True, stable=True)
    return list(torch.split(order, max(int(batch_size), 1))) if len(order) else []  # split() of nothing: [empty]


def share_batches(lengths: torch.Tensor, batch_size: int, group: DPGroup) -> torch.Tensor:
    """Positions (into ``lengths``) of the rows this rank computes in a no-grad pass that batches rows longest-first:
    the single worker's batches -- rows sorted by length (descending, stable), then chunks of ``batch_size`` -- a
    contiguous share of whole batches per rank, listed in that sorted order (so the rank's own longest-first batching
    of them rebuilds exactly those batches). Each batch then holds the same rows as with one worker, and its
    numerics -- GEMM blocking over the batch's rows, trimming to its longest row, BF16 rounding of every output --
    do not depend on the world size. (A share of rows, batched per rank, regroups them: on an AVX2 CPU with emulated
    BF16 that moved old logprobs by BF16 ulps and the second update's gradients of 2 ranks by 2e-3 relative.)"""
    batches = longest_first_batches(lengths, batch_size)
    mine = group.share(torch.arange(len(batches))).tolist()
    return torch.cat([batches[i] for i in mine]) if mine else lengths.new_zeros(0, dtype=torch.long)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, group: DPGroup) -> float:
    """Scale the gradients to a total L2 norm of at most ``max_norm`` (as torch's ``clip_grad_norm_``: coefficient
    ``max_norm / (norm + 1e-6)`` when below 1) and return the norm before clipping -- inf or nan when a gradient is
    not finite (the gradients are then left as they are; the caller skips the update).

    The norm is accumulated in float64 over this rank's shard of every gradient, then summed over ranks. torch's own
    norm is FP32 (on CPU a plain FP32 accumulation: 1e-5 relative off on a 3M-parameter model) and depends on how
    the tensors are sharded, so M ranks would clip by, and log, another norm than one worker."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    local, sq = [], None
    for g in grads:
        t = g.to_local() if hasattr(g, "to_local") else g
        local.append(t)
        part = torch.linalg.vector_norm(t, dtype=torch.float64).square()
        if hasattr(g, "placements") and not all(p.is_shard() for p in g.placements) and group.rank != 0:
            part = part * 0  # a replicated gradient: every rank holds all of it, count it once
        sq = part if sq is None else sq + part
    all_sum(sq, group=group)
    norm = float(sq.sqrt())
    if math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(local, coef)
    return norm


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
