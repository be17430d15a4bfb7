"""Data-parallel trainers: ``cluster.policy_workers`` PolicyWorkers as ranks of one ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU), the model sharded with torch's FSDP2 ``fully_shard`` (per decoder layer, then the
root): each rank holds 1/M of the FP32 masters, of the gradients and of the AdamW state.

A rank never holds the whole model: it builds the model on the meta device, converts and shards it, then
allocates and fills only its own shard from the checkpoint, one tensor at a time (:func:`load_model`,
:func:`materialize_shards`).

How the trainer uses it (trainer/policy.py) -- per-layer, as FSDP is meant to run: a decoder layer's full weights
exist only while that layer computes (gathered before its forward and again before its backward, freed after
each), gradients are reduce-scattered per layer as the backward passes it, and the root unit (embeddings, final
norm, output projection) is gathered for the whole forward. A rank's peak is its shards + the root + one decoder
layer's full weights (+ FSDP's prefetch of the next one) + activations. The FP8 linears and the BF16 emulation keep
no quantized / rounded copy of a gathered weight (:func:`shard_model` turns their caches off): they quantize per
use and again in the backward, which gives the same codes. With activation checkpointing
(:func:`checkpoint_layers`, applied to the same decoder layers before sharding) a layer's backward also runs its
forward again, inside the same gathering.

Per-layer collectives run inside every forward and backward, so every rank must run the same number of them: a
rank with fewer rows than another pads with forwards of one row whose result is discarded (no-grad passes) or
with zero-weighted micro-batches (``0 x`` the loss of one row: every layer's backward runs and adds zeros).

* Training: every rank gets the whole step's batch (one object in Ray's object store) and trains on a contiguous
  share of each optimizer update's rows, in micro-batches; each micro-batch's backward reduce-scatters its
  gradients, which FSDP accumulates into the sharded gradients (summed over ranks, not averaged: the loss is
  already normalized by the *global* update's tokens or sequences, known on every rank from the whole batch). With
  ``M`` dividing the update's rows and the micro-batch size dividing each share, rank ``r``'s micro-batches are
  exactly micro-batches of the single-worker run, so FP8 rounding (whose 1x128 groups along tokens depend on which
  rows share a micro-batch) is the same and only the order of the gradient sum differs.
* No-grad passes (old logprobs, Calibrated Clipping's FP8 and BF16-shadow passes, KV-scale calibration): inside
  :func:`per_layer_no_grad` each rank computes its share of the single worker's batches; :func:`all_sum` of
  zero-filled tensors assembles the full result on every rank (every rank then computes the same metrics and the
  same clip bounds).
* Refit and checkpoints: full weights (and full optimizer state) gathered to rank 0, which alone ships / writes
  them; the other ranks return nothing. A checkpoint has the single-worker layout, so a run resumes with any M.
  The full state reaches rank 0 parameter by parameter (torch's full state dict, offloaded to CPU) and the FP8 refit
  quantizes it there (fp8core.serve.served_state_dict from the state), no layer gathered: rank 0 then holds the
  full FP32 state (4 bytes per parameter) and the payload (FP8 codes and scales, BF16 for the rest) on top of its
  shard; the other ranks hold nothing more.

Every collective has the group's timeout (``cluster.collective_timeout_s``; by default 60 s on CPU, 600 s on GPUs): a
dead rank fails the step within it instead of gloo's 30-minute default.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DPGroup", "Rendezvous", "load_model", "materialize_shards", "init_group", "checkpoint_layers", "shard_model", "fsdp_modules", "per_layer_no_grad", "equal_count", "gathered_units", "all_sum", "all_min", "gather_objects", "full_tensor", "longest_first_batches",
           "share_batches", "clip_grad_norm"]


@dataclass(frozen=True)
class DPGroup:
    """This worker's place in the data-parallel group (``world == 1``: no group, everything local)."""

    rank: int = 0
    world: int = 1
    rendezvous: object = None  # a Ray actor handle of :class:`Rendezvous`: how rank 0 tells the others its store
    timeout_s: float = 60.0

    @property
    def active(self) -> bool:
        return self.world > 1

    def share(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of ``rows`` (sizes differ by at most one, larger ones first)."""
        return torch.tensor_split(rows, self.world)[self.rank] if self.active else rows


class Rendezvous:
    """Where a group's ranks learn the address of rank 0's ``TCPStore`` (run as a zero-CPU Ray actor).

    Rank 0 binds its store to a port the OS picks and posts ``host:port`` here; the others wait for it. Choosing a
    free port first and binding it later, in another process, lost the port to whatever took it in between (a CI
    run's rank 0 failed with EADDRINUSE)."""

    def __init__(self) -> None:
        self.address: str | None = None

    def post(self, address: str) -> None:
        self.address = address

    def address_of_rank0(self) -> str | None:
        return self.address


def _store(group: DPGroup):
    """Rank 0: a new TCPStore on a free port, its address posted; the others: a client of rank 0's store, once
    posted (waiting up to the group's timeout)."""
    import time

    import ray
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=group.timeout_s)
    if group.rank == 0:
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        store = dist.TCPStore(host, 0, group.world, True, timeout=timeout, wait_for_workers=False)
        ray.get(group.rendezvous.post.remote(f"{host}:{store.port}"))
        return store
    deadline, pause = time.monotonic() + group.timeout_s, 0.01
    while (address := ray.get(group.rendezvous.address_of_rank0.remote())) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"data-parallel rank {group.rank} of {group.world}: rank 0 did not open the group's "
                               f"rendezvous within {group.timeout_s:g} s (cluster.collective_timeout_s)")
        time.sleep(pause)
        pause = min(2 * pause, 0.5)
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), group.world, False, timeout=timeout)


def init_group(group: DPGroup, device: torch.device) -> None:
    """Join the process group (blocks until all ``world`` ranks joined or the timeout passed)."""
    import torch.distributed as dist

    if not group.active or dist.is_initialized():
        return
    if group.rendezvous is None:
        raise ValueError(f"data-parallel rank {group.rank} of {group.world}: no rendezvous (trainer.dp.Rendezvous)")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=_store(group),
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


def checkpoint_layers(model: nn.Module, recompute_context: Callable[[], contextlib.AbstractContextManager]) -> int:
    """Activation checkpointing per decoder layer (``policy.megatron_cfg.activation_checkpointing``): a layer's
    gradient-carrying forward keeps only its inputs, and the backward runs the layer's forward again to rebuild
    what its own backward needs (torch's non-reentrant checkpoint in its composable form: forward hooks on the
    layer, so parameter names and the module tree stay as they are). No-grad forwards save nothing either way.
    Returns the number of layers.

    Apply it before :func:`shard_model`. FSDP2 and this checkpoint are both forward hooks on the layer; FSDP's run
    outside the checkpoint's, and in the recompute (which calls the layer again) FSDP's hooks see its backward
    state and leave the gathering to its pre-backward hook, which has gathered the layer by then.

    The recompute must compute what the forward computed, under the state the forward ran under. torch restores
    the RNG state (no dropout here anyway) and autocast; anything else a caller sets around its forward --
    TorchFunctionModes such as the BF16 emulation (fp8core.bf16), MoE routing replay, KV rounding -- is gone by the
    backward. ``recompute_context()`` is called during each layer's forward and must return a context manager
    (not yet entered) that re-establishes that state; the recompute runs inside it."""
    from torch.distributed._composable import checkpoint

    def context_fn():
        return contextlib.nullcontext(), recompute_context()

    layers = decoder_layers(model)
    for layer in layers:
        checkpoint(layer, context_fn=context_fn)
    return len(layers)


def shard_model(model: nn.Module, device: torch.device) -> None:
    """FSDP2 over the group: each decoder layer, then the root (embeddings, final norm, lm_head). Gradients are
    summed over ranks, not averaged (the loss is normalized by the global token count). The FP8 linears' weight
    caches are turned off (a cached quantization of each gathered layer would be a second copy of the model)."""
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
    for m in model.modules():
        if getattr(m, "weight_cache", None) is not None:
            m.weight_cache = None  # fp8core.linear.FP8Linear: quantize per use, keep no copy


def load_model(model_dir, device: torch.device, group: DPGroup) -> nn.Module:
    """The FP32 model of ``model_dir`` for a trainer: loaded onto ``device``, or, on a data-parallel rank, built on
    the meta device (its config only, no weight allocated anywhere) to be converted (FP8 linears, routers,
    checkpointing) and sharded like a loaded model before :func:`materialize_shards` allocates and fills only this
    rank's shard."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not group.active:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def materialize_shards(model: nn.Module, model_dir, device: torch.device) -> None:
    """Allocate a sharded meta-built model (:func:`load_model`, then :func:`shard_model`) on ``device`` and fill it
    from ``model_dir``'s safetensors: each checkpoint tensor is read on the host one at a time and this rank keeps
    its shard of it (FSDP2's dim-0 chunk); non-persistent buffers (rotary frequencies) are computed again by their
    module's class from the model config. A rank so holds its shard + one full tensor, never the whole model."""
    from pathlib import Path

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    with contextlib.ExitStack() as files:  # each checkpoint file opened once
        where = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            st = files.enter_context(safe_open(str(f), framework="pt"))
            where.update(dict.fromkeys(st.keys(), st))
        model.to_empty(device=device)
        state = model.state_dict()
        # per state entry, its checkpoint tensors: [[name]], per-expert parts of a fused experts tensor, or None (a
        # tied alias's second name, a non-persistent buffer)
        sources = {name: [[name]] if name in where else _fused_experts(name, where) for name in state}
        missing = [n for n, _ in model.named_parameters() if sources.get(n) is None]  # one name per Parameter
        if missing:
            raise ValueError(f"{model_dir}: the checkpoint lacks {missing[:3]} (of {len(missing)})")
        with torch.no_grad():
            for name, t in state.items():
                parts = sources[name]
                if parts is None:
                    continue
                full = (where[name].get_tensor(name) if name in where else
                        torch.stack([torch.cat([where[k].get_tensor(k) for k in keys]) for keys in parts]))
                full = full.to(device=device, dtype=t.dtype)
                if isinstance(t, DTensor):
                    shard = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
                    t.to_local().copy_(shard)
                else:
                    t.copy_(full)
    with torch.no_grad():
        for module in model.modules():
            names = [b for b in module._buffers if b in module._non_persistent_buffers_set]
            if not names:
                continue
            try:
                fresh = type(module)(model.config)
            except TypeError as e:
                raise ValueError(f"{type(module).__name__}: its buffers {names} cannot be rebuilt from the model "
                                 f"config on a meta-built data-parallel rank ({e})") from None
            for b in names:
                module._buffers[b] = fresh._buffers[b].to(device)


def _fused_experts(name: str, where) -> list[list[str]] | None:
    """The checkpoint keys a fused experts tensor is made of, per expert (transformers fuses MoE experts on load:
    ``<p>.experts.gate_up_proj [E, 2I, H]`` = each expert's gate then up projection, ``<p>.experts.down_proj
    [E, H, I]`` = each expert's down projection, stored as ``<p>.experts.<e>.<proj>.weight``), or None."""
    prefix, _, kind = name.rpartition(".")
    projections = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(kind)
    if projections is None or not prefix.endswith("experts"):
        return None
    out, e = [], 0
    while all(f"{prefix}.{e}.{p}.weight" in where for p in projections):
        out.append([f"{prefix}.{e}.{p}.weight" for p in projections])
        e += 1
    return out or None


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def per_layer_no_grad(model: nn.Module, group: DPGroup) -> Iterator[None]:
    """No-grad forwards with per-layer gathering: every unit, the root included, is freed after its forward (the
    root otherwise keeps its weights gathered until a backward that a no-grad pass never runs). Every rank must run
    the same number of forwards inside (:func:`equal_count`). A no-op without a group."""
    if not group.active:
        yield
        return
    model.set_reshard_after_forward(True, recurse=False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(False, recurse=False)
        model.reshard()


def equal_count(n: int, group: DPGroup) -> int:
    """How many forwards (or micro-batches) every rank runs when ``n`` items are shared as :meth:`DPGroup.share`
    shares them: the largest share, which rank 0 holds (ranks with fewer pad up to it)."""
    return -(-n // group.world) if group.active else n


def gathered_units(model: nn.Module) -> int:
    """How many FSDP units of ``model`` hold their full (unsharded) weights right now: a test's probe of the
    per-layer promise (FSDP2's internal state; 0 without FSDP)."""
    count = 0
    for m in fsdp_modules(model):
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None and group.is_unsharded:
            count += 1
    return count


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


def longest_first_batches(lengths: torch.Tensor, batch_size: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """The no-grad passes' batching rule (trainer.logprobs.local_logprobs): positions sorted by length, descending
    and stable, in chunks of ``batch_size``; with ``max_tokens`` (sequence packing) in chunks of at most that many
    tokens instead (token_chunks)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    if max_tokens is not None:
        return token_chunks(order, lengths, max_tokens)
    return list(torch.split(order, max(int(batch_size), 1))) if len(order) else []  # split() of nothing: [empty]


def token_chunks(rows: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """``rows`` (positions into ``lengths``) in their order, cut into consecutive chunks of at most ``max_tokens``
    tokens each (a longer sequence alone in its chunk): the batches of sequence packing."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths[rows].tolist()):
        if total and total + n > max_tokens:
            out.append(rows[start:i])
            start, total = i, 0
        total += n
    if len(rows):
        out.append(rows[start:])
    return out


def share_batches(lengths: torch.Tensor, batch_size: int, group: DPGroup, max_tokens: int | None = None) -> torch.Tensor:
    """Positions (into ``lengths``) of the rows this rank computes in a no-grad pass that batches rows longest-first:
    the single worker's batches -- rows sorted by length (descending, stable), then chunks of ``batch_size`` -- a
    contiguous share of whole batches per rank, listed in that sorted order (so the rank's own longest-first batching
    of them rebuilds exactly those batches). Each batch then holds the same rows as with one worker, and its
    numerics -- GEMM blocking over the batch's rows, trimming to its longest row, BF16 rounding of every output --
    do not depend on the world size. (A share of rows, batched per rank, regroups them: on an AVX2 CPU with emulated
    BF16 that moved old logprobs by BF16 ulps and the second update's gradients of 2 ranks by 2e-3 relative.)"""
    batches = longest_first_batches(lengths, batch_size, max_tokens)
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
