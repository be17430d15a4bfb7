"""One forward of the policy and the state it runs under: token logprobs (+ entropies) of a micro-batch, with
sequence packing, MoE routing replay, the precision (autocast or the BF16 emulation) and the engine's KV rounding;
the zero-weighted padding forward of a data-parallel rank; the step's MoE routing counts (``moe/*``).

Functions of the PolicyWorker's state: ``worker`` is the PolicyWorker (trainer/policy.py) they read and update.
"""

from __future__ import annotations

import contextlib

import torch

from trainer.batch import Batch, Packed, token_logprobs


def autocast(precision: str, device: torch.device, bf16_emulation=None):
    """The forward's precision context: BF16 autocast, the BF16 emulation (``policy.bf16_mode`` emulated: an
    fp8core.bf16.BF16Emulation instance) or nothing (float32)."""
    if precision == "bfloat16":
        return bf16_emulation if bf16_emulation is not None else torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def enter_all(parts):
    """Enter ``parts`` (context managers) in order, exit them in reverse."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part)
        yield


def token_logp(worker, b: Batch, *, want_entropy: bool = False):
    """Forward one micro-batch; returns (logp [B, L] aligned to tokens, entropy [B, L] or None). With sequence
    packing (policy.sequence_packing.enabled) a batch of several rows runs as one row of its real tokens
    (trainer.batch.Packed), its results unpacked to the padded layout."""
    packed = Packed(b) if worker._packing and len(b) > 1 else None
    worker._positions[0] += b.tokens.numel() if packed is None else packed.tokens.numel()  # computed positions
    worker._positions[1] += int(b.attn.sum())  # of them real tokens: train/padding_frac
    if packed is None:
        tokens = b.tokens.to(worker.device)
        inputs = {"input_ids": tokens, "attention_mask": b.attn.to(worker.device)}
    else:  # no attention mask: the restarting position ids keep each sequence to itself
        tokens = packed.tokens.to(worker.device)
        inputs = {"input_ids": tokens, "position_ids": packed.position_ids.to(worker.device),
                  **(packed.attention_kwargs(worker.device) if worker._packed_attention else {})}
    replay = None
    if worker.router_replay and b.routing is not None:  # R3: the engine's experts for every token
        k = b.routing.shape[-1]
        routing = b.routing if packed is None else b.routing[packed.real][None]
        replay = {layer: routing[:, :, j].reshape(-1, k).to(worker.device)
                  for j, layer in enumerate(worker.moe_layers)}
    try:
        worker._recompute = lambda: forward_contexts(worker, replay)  # each checkpointed layer's recompute
        with forward_contexts(worker, replay):
            logits = worker.model(**inputs).logits
    finally:
        worker._recompute = None
    if worker._moe_measure:
        record_routing(worker, b, packed)
    logp, z = token_logprobs(logits, tokens, temperature=worker.cfg.policy.generation.temperature)
    ent = None
    if want_entropy:
        from fp8core.rl.metrics import token_entropy

        e = token_entropy(z.detach())
        ent = torch.cat([torch.zeros_like(e[:, :1]), e], dim=1)
    if packed is not None:  # a sequence's first token follows the previous sequence: no logprob, no entropy
        starts = packed.starts.to(logp.device)[None]
        logp = packed.unpack(logp.masked_fill(starts, 0.0))
        ent = None if ent is None else packed.unpack(ent.masked_fill(starts, 0.0))
    return logp, ent


def forward_contexts(worker, replay: dict | None) -> contextlib.AbstractContextManager:
    """The state a forward runs under: MoE routing replay (``replay``: the engine's experts per MoE layer, or
    None), the precision (autocast or the BF16 emulation) and the engine's KV rounding. A context manager
    not yet entered, its parts fixed now; activation checkpointing enters a copy around each layer's
    recompute (the backward runs outside the forward's ``with``)."""
    from fp8core.moe import forced_routing

    parts = [forced_routing(worker.model, replay), autocast(worker.cfg.policy.precision, worker.device,
                                                            worker.bf16_emulation), kv_replay(worker)]
    return enter_all(parts)


def kv_replay(worker):
    """The engine's FP8 KV rounding around a forward (calibration.kv_rounding_in_trainer), else nothing."""
    if not worker.kv_rounding or worker._kv_rounding_paused:
        return contextlib.nullcontext()
    from trainer.kv_rounding import kv_rounding, unit_scales

    scales = worker.kv_scales
    if scales is None:
        from fp8core.rl.kv_calibration import find_attention_modules

        scales = unit_scales(len(find_attention_modules(worker.model)))
    return kv_rounding(worker.model, scales, round_k=True, round_v=True)


def zero_loss(worker, one: Batch) -> torch.Tensor:
    """0 x a full forward of ``one``: a data-parallel rank's padding micro-batch (its backward runs every layer's
    collectives and adds zeros: trainer/dp.py); under no_grad a padding forward."""
    measure, worker._moe_measure = worker._moe_measure, False  # not a real forward: no moe/* counts
    try:
        return token_logp(worker, one)[0].sum() * 0.0
    finally:
        worker._moe_measure = measure


@torch.no_grad()
def record_routing(worker, b: Batch, packed: Packed | None = None) -> None:
    """Accumulate this forward's routing for the step's ``moe/*`` metrics (real tokens only): tokens whose own
    top-k set differs from the engine's, and the per-layer expert loads of the experts used. ``packed``: the
    forward ran the batch packed (its tokens are all real)."""
    from fp8core.moe import routers

    real = b.attn.reshape(-1).bool()
    ran = real if packed is None else slice(None)  # the forward's tokens that are real: all of a packed row's
    acc = worker._moe_acc
    for j, (_, r) in enumerate(routers(worker.model)):
        used = r.last_ids.cpu()[ran]
        acc["counts"][j] += torch.bincount(used.reshape(-1), minlength=r.num_experts).double()
        if b.routing is not None:
            own = r.last_own_ids.cpu()[ran].sort(-1).values
            eng = b.routing[:, :, j].reshape(-1, b.routing.shape[-1])[real].sort(-1).values
            acc["mismatch"] += int((own != eng).any(-1).sum())
            acc["tokens"] += int(real.sum())


def start_moe_measure(worker) -> None:
    """Count routing (``moe/*``) in the forwards from now until ``worker._moe_measure`` is set back to False."""
    from fp8core.moe import routers

    n_exp = routers(worker.model)[0][1].num_experts
    worker._moe_measure = True
    worker._moe_acc = {"mismatch": 0, "tokens": 0,
                       "counts": torch.zeros(len(worker.moe_layers), n_exp, dtype=torch.float64)}


def moe_metrics(worker) -> dict[str, float]:
    acc, m = worker._moe_acc, {"moe/router_replay": float(worker.router_replay)}
    if acc["tokens"]:
        m["moe/routing_mismatch_frac"] = acc["mismatch"] / acc["tokens"]
    c = acc["counts"]
    share = c / c.mean(1, keepdim=True).clamp_min(1e-12)  # per layer: expert load / the uniform load
    m["moe/expert_load_max"] = float(share.max(1).values.mean())
    m["moe/expert_load_min"] = float(share.min(1).values.mean())
    m["moe/expert_load_cv"] = float((c.std(1, unbiased=False) / c.mean(1).clamp_min(1e-12)).mean())
    return m
