"""Clipped policy-gradient loss for GRPO / DAPO / GSPO, with dual-clip, k3 KL and per-token IS weights.

Public API
----------
``clipped_pg_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip=None, ratio_level="token",
loss_agg="token_mean", ref_logp=None, kl_coef=0.0, is_weights=None, normalizer=None) -> (loss, metrics)``
``RatioLevel`` (TOKEN, SEQUENCE) and ``LossAgg`` (TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM): str enums; the
string values are accepted wherever the enum is.

Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``is_weights`` are ``[B, T]``; ``advantages`` is ``[B]`` (one per
sequence) or ``[B, T]``. ``mask`` is 1 on generated tokens that count; padding (and anything masked) never contributes to
the loss, its gradient or the metrics, whatever values sit there (even inf/NaN).

Formulas (per valid token t of sequence i, ``A`` the advantage, ``[L, H]`` = ``[clip_low, clip_high]``)
-------------------------------------------------------------------------------------------------------
ratio, ``ratio_level=TOKEN`` (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024; DAPO, Yu et al. 2025):
    ``r_it = exp(logp_it - old_logp_it)``
ratio, ``ratio_level=SEQUENCE`` (GSPO, Zheng et al. 2025, arXiv:2507.18071, eq. 7): the length-normalized geometric mean
    ``s_i = exp( (1/|y_i|) sum_t (logp_it - old_logp_it) )``, used for every token of sequence i (gradient flows through
    s_i to every token). GSPO's "own clip" is simply the ``[L, H]`` passed in (GSPO uses ~[1 - 3e-4, 1 + 4e-4]).
surrogate: ``pg_it = max(-A r, -A clamp(r, L, H))``  (= -min(r A, clip(r) A), PPO eq. 7 with DAPO's decoupled L = 1 - eps_low,
    H = 1 + eps_high "clip-higher"; L and H are passed directly so Calibrated Clipping can move them).
dual-clip (Ye et al. 2020, arXiv:1912.09729, eq. 5): for ``A < 0``, ``pg_it = min(pg_it, -c A)`` with ``c = dual_clip > 1``
    (bounds the loss of a negative-advantage token whose ratio exploded).
IS correction: ``pg_it *= w_it`` with detached per-token weights ``w`` (see ``fp8core.rl.importance``).
KL to a reference policy (Schulman, http://joschu.net/blog/kl-approx.html; GRPO eq. 4), ``kl_type`` of
    ``d = logp - ref_logp`` (clamped to ``[-kl_input_clamp, kl_input_clamp]`` when given):
    k1 ``d``; k2 ``d^2 / 2``; k3 (default) ``exp(-d) + d - 1``; the estimate clamped to
    ``[-kl_output_clamp, kl_output_clamp]`` when given (NeMo RL's kl_input / kl_output clamps); also multiplied by
    ``w_it`` when IS weights are given (the tokens were sampled from the rollout policy, the weights re-target the
    expectation to pi_old); ``loss_it = pg_it + kl_coef * kl_it``.
aggregation (explicit, ``m`` the mask, ``n_i = sum_t m_it``; sequences with n_i = 0 are not counted):
    TOKEN_MEAN           sum_it loss_it m_it / sum_it m_it                      (DAPO token-level normalization, eq. 8)
    SEQ_MEAN_TOKEN_MEAN  mean_i [ sum_t loss_it m_it / n_i ]                   (original GRPO eq. 3; GSPO)
    SEQ_MEAN_TOKEN_SUM   mean_i [ sum_t loss_it m_it ]                         (Dr. GRPO-like, no length division)
    ``normalizer`` (optional) replaces the denominator (global token count for TOKEN_MEAN, global sequence count for the
    SEQ_* modes) so gradient accumulation over micro-batches reproduces the full-batch loss.

Metrics returned (python floats): ``loss/pg``, ``loss/reference_kl`` (mean KL estimate over valid tokens, 0 without
ref), ``loss/total``,
and ``clip_metrics`` (``clip/*``, see ``fp8core.rl.metrics``) computed on the ratio actually clipped.
"""
from __future__ import annotations

from enum import Enum, StrEnum

import torch

from fp8core.choices import KL_TYPES
from fp8core.rl.metrics import clip_metrics, masked_mean

__all__ = ["RatioLevel", "LossAgg", "KL_TYPES", "clipped_pg_loss", "reference_kl", "sequence_log_ratio"]


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str = "k3", *,
                 input_clamp: float | None = None, output_clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) at sampled tokens (module docstring): k1 ``d``, k2 ``d^2 / 2``, k3
    ``exp(-d) + d - 1`` with ``d = logp - ref_logp``; optional clamps of ``d`` and of the estimate."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {', '.join(KL_TYPES)}, got {kl_type!r}")
    d = logp - ref_logp
    if input_clamp is not None:
        d = d.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = d
    elif kl_type == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(-d) + d - 1.0
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


class RatioLevel(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"


class LossAgg(StrEnum):
    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"


def _coerce(enum_cls: type[Enum], value, name: str):
    try:
        return enum_cls(value)
    except ValueError:
        allowed = [e.value for e in enum_cls]
        raise ValueError(f"{name}={value!r} is not one of {allowed}") from None


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO length-normalized log sequence ratio ``(1/|y_i|) sum_t (logp - old_logp)`` -> ``[B]`` (0 for empty rows)."""
    valid = mask.bool()
    d = torch.where(valid, logp - old_logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return d.sum(dim=-1) / valid.sum(dim=-1).clamp_min(1).to(d.dtype)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: LossAgg, normalizer: float | None) -> torch.Tensor:
    m = mask.to(per_token.dtype)
    per_token = torch.where(mask.bool(), per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if agg is LossAgg.TOKEN_MEAN:
        denom = m.sum().clamp_min(1.0) if normalizer is None else normalizer
        return (per_token * m).sum() / denom
    lengths = m.sum(dim=-1)
    seq_sum = (per_token * m).sum(dim=-1)
    if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        seq_val = seq_sum / lengths.clamp_min(1.0)
    else:
        seq_val = seq_sum
    denom = (lengths > 0).sum().clamp_min(1).to(per_token.dtype) if normalizer is None else normalizer
    return seq_val.sum() / denom


def clipped_pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    ratio_level: RatioLevel | str = RatioLevel.TOKEN,
    loss_agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
    normalizer: float | None = None,
    kl_type: str = "k3",
    kl_input_clamp: float | None = None,
    kl_output_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss (formulas in the module docstring). Returns ``(scalar loss, metrics)``."""
    level = _coerce(RatioLevel, ratio_level, "ratio_level")
    agg = _coerce(LossAgg, loss_agg, "loss_agg")
    if not 0.0 < clip_low < clip_high:
        raise ValueError(f"need 0 < clip_low < clip_high, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got dual_clip={dual_clip}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("is_weights", is_weights)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match batch size {logp.shape[0]}")
        advantages = advantages[:, None].expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != logp shape {tuple(logp.shape)}")

    valid = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    old = old_logp.detach()
    if level is RatioLevel.TOKEN:
        ratio = torch.exp(torch.where(valid, logp - old, zero))
    else:
        ratio = torch.exp(sequence_log_ratio(logp, old, mask))[:, None].expand_as(logp)

    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(clip_low, clip_high))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    w = None
    if is_weights is not None:
        w = torch.where(valid, is_weights.detach().to(logp.dtype), zero)
        pg = pg * w

    kl = torch.zeros_like(pg)
    if ref_logp is not None:
        # padding zeroed before the estimate: a NaN there must not reach the gradient through the where
        kl = torch.where(valid, reference_kl(torch.where(valid, logp, zero), torch.where(valid, ref_logp.detach(), zero),
                                             kl_type, input_clamp=kl_input_clamp, output_clamp=kl_output_clamp), zero)
        if w is not None:
            kl = kl * w
    per_token = pg + kl_coef * kl
    loss = _aggregate(per_token, mask, agg, normalizer)

    metrics = {
        "loss/pg": float(masked_mean(pg.detach(), mask)),
        "loss/reference_kl": float(masked_mean(kl.detach(), mask)),
        "loss/total": float(loss.detach()),
    }
    metrics.update(clip_metrics(ratio.detach(), adv, mask, clip_low=clip_low, clip_high=clip_high))
    return loss, metrics
