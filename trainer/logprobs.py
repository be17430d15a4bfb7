"""The trainer's no-grad logprob passes: the policy's logprobs (+ entropies) of a batch, batched longest-first and
shared between data-parallel ranks; the scoring of rollouts (``PolicyWorker.score``); the BF16 shadow's logprobs
(Calibrated Clipping); the reference policy of the KL term and its logprobs.

Functions of the PolicyWorker's state: ``worker`` is the PolicyWorker (trainer/policy.py) they read and update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from trainer.batch import Batch, by_length
from trainer.dp import all_sum as dp_sum
from trainer.dp import equal_count, longest_first_batches, per_layer_no_grad, share_batches
from trainer.forward import moe_metrics, start_moe_measure, token_logp, zero_loss


def reference_model(worker):
    """The reference policy of the KL term: the initial policy (``policy.model_name``), built as the policy is
    (FP32 masters, the recipe's FP8 linears), frozen and in eval mode. Not with MoE models (their routing replay
    and routing counts are the policy's)."""
    from trainer.dp import load_model

    if worker.moe_layers:
        raise ValueError("loss_fn.reference_policy_kl_penalty: a reference-policy KL term is not supported for "
                         "MoE models (routing replay covers the policy only); set it to 0")
    ref = load_model(worker.model_dir, worker.device, worker.dp)  # on a rank: sharded and filled like the policy
    ref.config.use_cache = False
    if worker.fp8_spec is not None:
        worker.fp8_spec.convert(ref)
    ref.requires_grad_(False)
    return ref.eval()


def reference_logprobs(worker, b: Batch) -> torch.Tensor:
    """The reference policy's logprobs of ``b`` through the trainer's own logprob pass (``PolicyWorker.logprobs``,
    with the reference model in the policy's place)."""
    policy = worker.model
    worker.model = worker.ref_model
    try:
        return worker.logprobs(b)[0]
    finally:
        worker.model = policy


@torch.no_grad()
def no_grad_logprobs(worker, b: Batch, *, want_entropy: bool = False, rows: torch.Tensor | None = None):
    """No-grad logprobs (FP32) and entropies (FP64) ``[B, L]`` of ``b`` (of ``b.slice(rows)`` when given). Rows
    are batched longest-first and each batch is trimmed to its own longest sequence (less padding); results come
    back in the input order, zero beyond each batch's width. Data-parallel (a collective: every rank calls it
    with the same arguments): each rank computes a share of the single worker's batches (whole batches:
    trainer.dp.share_batches), gathering one layer at a time, and pads with discarded forwards up to rank 0's
    count; the sum over ranks assembles them on every rank."""
    if not worker.dp.active:
        return local_logprobs(worker, b, want_entropy=want_entropy, rows=rows)
    rows = torch.arange(len(b)) if rows is None else rows
    lengths = b.attn[rows].sum(1)
    bs = worker.cfg.policy.logprob_batch_size
    mine = share_batches(lengths, bs, worker.dp, worker._logprob_tokens)
    n_batches = len(longest_first_batches(lengths, bs, worker._logprob_tokens))
    pad = equal_count(n_batches, worker.dp) - len(worker.dp.share(torch.arange(n_batches)))
    lp = torch.zeros(len(rows), b.width)
    ent = torch.zeros(len(rows), b.width, dtype=torch.float64) if want_entropy else None
    with per_layer_no_grad(worker.model, worker.dp):
        if len(mine):
            lp_m, ent_m = local_logprobs(worker, b, want_entropy=want_entropy, rows=rows[mine])
            lp[mine] = lp_m.float()
            if ent is not None:
                ent[mine] = ent_m.double()
        padding_forwards(worker, pad, b.slice(rows[:1]).trimmed())
    dp_sum(*(t for t in (lp, ent) if t is not None), group=worker.dp)
    return lp, ent


@torch.no_grad()
def padding_forwards(worker, n: int, one: Batch) -> None:
    """``n`` discarded forwards of ``one``: a data-parallel rank with fewer batches than rank 0 runs the per-layer
    collectives of the forwards it lacks (trainer/dp.py)."""
    was = worker.model.training
    worker.model.eval()
    for _ in range(n):
        zero_loss(worker, one)
    worker.model.train(was)


@torch.no_grad()
def local_logprobs(worker, b: Batch, *, want_entropy: bool = False, rows: torch.Tensor | None = None):
    was = worker.model.training
    worker.model.eval()
    sub = b if rows is None else b.slice(rows)
    out = by_length(sub, worker.cfg.policy.logprob_batch_size,
                    lambda mb: token_logp(worker, mb, want_entropy=want_entropy), worker._logprob_tokens)
    worker.model.train(was)
    return out


@torch.no_grad()
def score_rollouts(worker, rollouts: Sequence[Mapping]) -> dict:
    """Teacher-forced logprobs of ``rollouts`` (RolloutWorker.generate output) with this trainer as it trains:
    the forward of ``train_step``'s old-logprob pass (its FP8 linears, ``policy.precision``, MoE routing replay
    and KV rounding as configured), no update. Returns ``{"logp": [B, L], "batch": Batch, "metrics": ...}`` with
    ``mismatch/*`` against the rollout's logprobs (fp8core.rl.mismatch_metrics, as logged every step),
    ``tokens`` and, for MoE models, ``moe/*``. What the diagnostics (mismatch tables, KV attribution) measure."""
    from fp8core.rl import mismatch_metrics

    b = Batch.from_rollouts(rollouts, pad_id=worker.tokenizer.pad_token_id)
    if worker.moe_layers:
        start_moe_measure(worker)
    try:
        lp, _ = worker.logprobs(b)
    finally:
        worker._moe_measure = False
    m = mismatch_metrics(lp, b.rollout_logp, b.mask)
    m["tokens"] = int(b.mask.sum())
    if worker.moe_layers:
        m.update(moe_metrics(worker))
    return {"logp": lp, "batch": b, "metrics": m}


def shadow_logprobs(worker, b: Batch) -> torch.Tensor:
    from fp8core.convert import high_precision

    paused, worker._kv_rounding_paused = worker._kv_rounding_paused, True  # the BF16 pipeline has no FP8 cache
    try:
        with high_precision(worker.model):
            return worker.logprobs(b)[0]
    finally:
        worker._kv_rounding_paused = paused
