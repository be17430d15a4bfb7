"""Importance-sampling correction between the rollout engine (behaviour policy) and the trainer.

Behaviour policy ``mu`` = the rollout engine's logprobs (vLLM, possibly FP8); ``pi_old`` = the trainer's logprobs of the
same tokens before the update. Per token ``rho_t = pi_old / mu = exp(old_logp - rollout_logp)``. The weights multiply the
per-token loss (``clipped_pg_loss(..., is_weights=w)``) and are always detached. Padding gets weight 0.

Public API
----------
``ISKind`` (str enum): ``TIS = "tis"``, ``ICE_POP = "icepop"``, ``SEQ_MASK_TIS = "seq_mask_tis"``.
``tis_weights(old_logp, rollout_logp, mask, *, cap=2.0)``
    Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
    NeMo RL ``use_importance_sampling_correction``): ``w_t = min(rho_t, C)``.
``icepop_weights(old_logp, rollout_logp, mask, *, low=0.5, high=5.0)``
    IcePop (Ling team 2025, "Every Step Evolves", Ring-1T): ``w_t = rho_t if low <= rho_t <= high else 0`` (tokens with a
    too-large mismatch are dropped instead of reweighted).
``seq_mask_tis_weights(old_logp, rollout_logp, mask, *, low=0.999, high=1.002, cap=2.0)``
    Sequence-masked TIS: the geometric-mean weight ``rho_i = exp(mean_t log rho_it)`` decides per sequence; a sequence with
    ``rho_i`` outside ``[low, high]`` gets weight 0 on every token, the kept ones get token TIS weights ``min(rho_t, C)``.
``importance_weights(old_logp, rollout_logp, mask, *, kind, cap=2.0, low=None, high=None) -> (weights, metrics)``
    Dispatches on ``kind`` (``low``/``high`` default to the kind's defaults above) and returns the ``is/*`` metrics
    (``is/weight_mean``, ``is/weight_max``, ``is/frac_truncated``; see ``fp8core.rl.metrics.is_metrics``).
"""
from __future__ import annotations

from enum import StrEnum

import torch

from fp8core.choices import IMPORTANCE_SAMPLING
from fp8core.rl.metrics import is_metrics

__all__ = ["ISKind", "tis_weights", "icepop_weights", "seq_mask_tis_weights", "importance_weights", "raw_is_ratio"]


class ISKind(StrEnum):
    """The importance weights by name; the names are fp8core.choices.IMPORTANCE_SAMPLING (the schema's
    ``loss_fn.importance_sampling``), checked on import."""

    TIS = "tis"
    ICE_POP = "icepop"
    SEQ_MASK_TIS = "seq_mask_tis"


assert tuple(ISKind) == IMPORTANCE_SAMPLING, "ISKind must list fp8core.choices.IMPORTANCE_SAMPLING, in order"


def _check(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)}, "
            f"mask {tuple(mask.shape)}"
        )


def _log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _check(old_logp, rollout_logp, mask)
    valid = mask.bool()
    d = old_logp.detach().to(torch.float32) - rollout_logp.detach().to(torch.float32)
    return torch.where(valid, d, torch.zeros((), dtype=d.dtype, device=d.device))


def raw_is_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``rho_t = exp(old_logp - rollout_logp)`` on valid tokens, 0 on padding (float32, detached)."""
    return torch.exp(_log_ratio(old_logp, rollout_logp, mask)) * mask.to(torch.float32)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0):
    """Token-level truncated IS: ``min(rho_t, cap)``."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got cap={cap}")
    return raw_is_ratio(old_logp, rollout_logp, mask).clamp_max(cap)


def icepop_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, low: float = 0.5, high: float = 5.0
):
    """IcePop: ``rho_t`` inside ``[low, high]``, 0 outside."""
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high, got low={low}, high={high}")
    rho = raw_is_ratio(old_logp, rollout_logp, mask)
    return torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))


def seq_mask_tis_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.999,
    high: float = 1.002,
    cap: float = 2.0,
):
    """Sequence-masked TIS: zero sequences whose geometric-mean weight is outside ``[low, high]``; TIS elsewhere."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")
    d = _log_ratio(old_logp, rollout_logp, mask)
    n = mask.to(torch.float32).sum(dim=-1).clamp_min(1.0)
    geo = torch.exp(d.sum(dim=-1) / n)
    keep = (geo >= low) & (geo <= high)
    return tis_weights(old_logp, rollout_logp, mask, cap=cap) * keep[:, None].to(torch.float32)


_DEFAULT_BANDS = {ISKind.ICE_POP: (0.5, 5.0), ISKind.SEQ_MASK_TIS: (0.999, 1.002)}


def importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: ISKind | str,
    cap: float = 2.0,
    low: float | None = None,
    high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights of the given ``kind`` plus ``is/*`` metrics."""
    try:
        kind = ISKind(kind)
    except ValueError:
        raise ValueError(f"kind={kind!r} is not one of {[k.value for k in ISKind]}") from None
    if kind is ISKind.TIS:
        w = tis_weights(old_logp, rollout_logp, mask, cap=cap)
    else:
        dlow, dhigh = _DEFAULT_BANDS[kind]
        lo = dlow if low is None else low
        hi = dhigh if high is None else high
        if kind is ISKind.ICE_POP:
            w = icepop_weights(old_logp, rollout_logp, mask, low=lo, high=hi)
        else:
            w = seq_mask_tis_weights(old_logp, rollout_logp, mask, low=lo, high=hi, cap=cap)
    return w, is_metrics(w, raw_is_ratio(old_logp, rollout_logp, mask), mask)
