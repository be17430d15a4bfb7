"""Per-step RL metrics with stable slash names; every function returns ``dict[str, float]`` (python floats).

Conventions: ``mask`` is ``[B, T]`` (1 = generated token that counts, 0 = prompt/padding); all statistics are over valid
tokens only, computed in float64, so they are invariant to the order of sequences in the batch and to extra padding.
An empty selection (0 valid tokens) gives 0.0, never NaN. ``d = logp_train - logp_rollout`` per token,
``rho = exp(d) = pi_train / pi_rollout`` (the sampled tokens come from the rollout engine's policy).

Names
-----
mismatch_metrics(train_logp, rollout_logp, mask)
    ``mismatch/token_mult_prob_error``  mean exp(|d|)  (NeMo RL's multiplicative probability error; 1.0 = no mismatch)
    ``mismatch/kl_k3_rollout_train``    mean (rho - 1 - d): Schulman's k3 estimator of KL(rollout || train); unbiased, since
                                        tokens are sampled from the rollout policy (http://joschu.net/blog/kl-approx.html)
    ``mismatch/kl_k3_train_rollout``    mean (1/rho - 1 + d): the same k3 form with the roles swapped, a diagnostic for
                                        KL(train || rollout) (not importance-corrected; both are >= 0 per token)
    ``mismatch/js``                     mean f(rho), f(rho) = 0.5 [rho log rho - (1 + rho) log((1 + rho) / 2)]: the
                                        Jensen-Shannon divergence as an f-divergence estimated with rollout samples
                                        (f convex, f(1) = f'(1) = 0, so every term is >= 0; bounded by log 2 in expectation)
    ``mismatch/max_abs_logp_diff``      max |d| over valid tokens
    ``mismatch/frac_abs_logp_diff_gt_1``  fraction of valid tokens with |d| > 1 (a probability off by more than e-fold)
    ``mismatch/excess_share_abs_logp_diff_gt_1``  sum over those tokens of (exp(|d|) - 1) / sum over all valid tokens of
                                        (exp(|d|) - 1): the share of ``token_mult_prob_error - 1`` they carry (0 when
                                        there is no mismatch). exp(|d|) is heavy-tailed: one token with |d| = 9 among
                                        2,000 adds 4 to the mean, so a spike of the mean with a share near 1 and a tiny
                                        fraction is a handful of tokens, not a shift of the whole distribution.
is_metrics(weights, ratio, mask)
    ``is/weight_mean``, ``is/weight_max`` over valid tokens; ``is/frac_truncated`` = fraction of valid tokens whose weight
    differs from the raw ratio ``pi_old / pi_rollout`` (clamped, zeroed or masked).
clip_metrics(ratio, advantages, mask, *, clip_low, clip_high)
    ``clip/lower_neg_adv_frac`` = #(valid, A < 0, r < L) / #(valid, A < 0)   <- the paper's failure signal: these tokens'
                                   gradients are zeroed by the PPO min, so FP8 noise that pushes r below L silences them.
    ``clip/lower_pos_adv_frac`` = #(valid, A > 0, r < L) / #(valid, A > 0)   (ratio outside the band, gradient not zeroed)
    ``clip/upper_pos_adv_frac`` = #(valid, A > 0, r > H) / #(valid, A > 0)   (gradient zeroed)
    ``clip/upper_neg_adv_frac`` = #(valid, A < 0, r > H) / #(valid, A < 0)   (gradient not zeroed unless dual-clip)
    ``clip/ratio_min``, ``clip/ratio_mean``, ``clip/ratio_max`` over valid tokens; ``clip/bound_low`` = L, ``clip/bound_high`` = H.
    "Clipped" is strict (r < L, r > H): at r == L the clamp changes nothing.
pool_clip_metrics(parts)
    The ``clip_metrics`` of several micro-batches pooled as if computed on their union: each fraction weighted by
    its population (#valid tokens with A < 0, resp. A > 0), ``ratio_min`` / ``ratio_max`` the extremes, ``ratio_mean``
    weighted by valid tokens (micro-batches without valid tokens ignored). Used to report the clip fractions over the
    optimizer updates after the first of an RL step (the first update's ratio is exactly 1).
entropy_metrics(mask, *, logits=None, logp=None)
    ``policy/entropy``: mean over valid tokens of the full-vocabulary entropy ``logsumexp(z) - sum softmax(z) z`` when
    ``logits`` ([B, T, V]) are given, else the sampled-token estimate mean(-logp) (unbiased when the tokens were sampled
    from the same policy at temperature 1).
response_length_metrics(mask)
    ``response/length_mean`` (and ``response/length_max``): valid tokens per sequence.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "masked_mean",
    "mismatch_metrics",
    "is_metrics",
    "clip_metrics",
    "pool_clip_metrics",
    "entropy_metrics",
    "token_entropy",
    "response_length_metrics",
]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask) / max(sum(mask), 1)`` in float64 (padding never contributes; empty -> 0)."""
    m = mask.to(torch.float64)
    xm = torch.where(m > 0, x.to(torch.float64), torch.zeros((), dtype=torch.float64))
    return (xm * m).sum() / m.sum().clamp_min(1.0)


def _masked_minmax(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    sel = x.detach().to(torch.float64)[mask.bool()]
    if sel.numel() == 0:
        return 0.0, 0.0
    return float(sel.min()), float(sel.max())


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Trainer-vs-rollout mismatch metrics (formulas in the module docstring)."""
    _check_same_shape(train_logp=train_logp, rollout_logp=rollout_logp, mask=mask)
    valid = mask.bool()
    d = (train_logp.detach().to(torch.float64) - rollout_logp.detach().to(torch.float64))
    d = torch.where(valid, d, torch.zeros_like(d))
    rho = torch.exp(d)
    k3_rt = rho - 1.0 - d
    k3_tr = torch.exp(-d) - 1.0 + d
    # rho*log(rho) - (1+rho)*log((1+rho)/2) with log(1+rho) = softplus(d)
    js = 0.5 * (rho * d - (1.0 + rho) * (torch.nn.functional.softplus(d) - math.log(2.0)))
    ad = d.abs()
    excess = torch.expm1(ad)  # 0 at invalid tokens (d is 0 there)
    big = valid & (ad > 1.0)
    total_excess = float(excess.sum())
    return {
        "mismatch/token_mult_prob_error": float(masked_mean(torch.exp(ad), mask)),
        "mismatch/kl_k3_train_rollout": float(masked_mean(k3_tr, mask)),
        "mismatch/kl_k3_rollout_train": float(masked_mean(k3_rt, mask)),
        "mismatch/js": float(masked_mean(js.clamp_min(0.0), mask)),
        "mismatch/max_abs_logp_diff": _masked_minmax(ad, mask)[1],
        "mismatch/frac_abs_logp_diff_gt_1": _frac(big, valid),
        "mismatch/excess_share_abs_logp_diff_gt_1": float(excess[big].sum()) / total_excess if total_excess > 0 else 0.0,
    }


def is_metrics(weights: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """IS weight statistics; ``ratio`` is the raw ``pi_old / pi_rollout`` before truncation/masking."""
    _check_same_shape(weights=weights, ratio=ratio, mask=mask)
    w = weights.detach().to(torch.float64)
    changed = (w != ratio.detach().to(torch.float64)).to(torch.float64)
    _, wmax = _masked_minmax(w, mask)
    return {
        "is/weight_mean": float(masked_mean(w, mask)),
        "is/weight_max": wmax,
        "is/frac_truncated": float(masked_mean(changed, mask)),
    }


def _frac(selected: torch.Tensor, population: torch.Tensor) -> float:
    n = population.sum()
    return float((selected & population).sum() / n) if n > 0 else 0.0


def clip_metrics(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> dict[str, float]:
    """Clip fractions split by advantage sign, ratio range and the current bounds (definitions in the module docstring).

    ``advantages`` may be ``[B]`` (one per sequence, broadcast over tokens) or ``[B, T]``.
    """
    r = ratio.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    if adv.dim() == 1 and r.dim() == 2:
        adv = adv[:, None].expand_as(r)
    _check_same_shape(ratio=r, advantages=adv, mask=mask)
    valid = mask.bool()
    neg = valid & (adv < 0)
    pos = valid & (adv > 0)
    below = r < clip_low
    above = r > clip_high
    rmin, rmax = _masked_minmax(r, mask)
    return {
        "clip/lower_neg_adv_frac": _frac(below, neg),
        "clip/lower_pos_adv_frac": _frac(below, pos),
        "clip/upper_pos_adv_frac": _frac(above, pos),
        "clip/upper_neg_adv_frac": _frac(above, neg),
        "clip/ratio_min": rmin,
        "clip/ratio_mean": float(masked_mean(r, mask)),
        "clip/ratio_max": rmax,
        "clip/bound_low": float(clip_low),
        "clip/bound_high": float(clip_high),
    }


CLIP_FRACTIONS = {"clip/lower_neg_adv_frac": "neg", "clip/lower_pos_adv_frac": "pos",
                  "clip/upper_pos_adv_frac": "pos", "clip/upper_neg_adv_frac": "neg"}


def pool_clip_metrics(parts) -> dict[str, float]:
    """Pool ``clip_metrics`` results of micro-batches: ``parts`` is an iterable of ``(metrics, advantages, mask)``
    (advantages ``[B]`` or ``[B, T]`` as given to ``clip_metrics``). Returns the fractions and ratio statistics of the
    union (definitions in the module docstring; an empty union gives 0.0 for each) and the clip bounds the parts
    used (``clip/bound_low``, ``clip/bound_high``: one pair, a ValueError if they differ; absent without parts)."""
    num = {k: 0.0 for k in CLIP_FRACTIONS}
    den = {"neg": 0.0, "pos": 0.0, "valid": 0.0}
    rmin, rmax, rsum = math.inf, -math.inf, 0.0
    for m, adv, mask in parts:
        a = adv.detach().to(torch.float64)
        if a.dim() == 1 and mask.dim() == 2:
            a = a[:, None].expand(mask.shape)
        valid = mask.bool()
        n = {"neg": float((valid & (a < 0)).sum()), "pos": float((valid & (a > 0)).sum()), "valid": float(valid.sum())}
        for k, pop in CLIP_FRACTIONS.items():
            num[k] += m[k] * n[pop]
        for pop, c in n.items():
            den[pop] += c
        if n["valid"] > 0:
            rmin, rmax = min(rmin, m["clip/ratio_min"]), max(rmax, m["clip/ratio_max"])
            rsum += m["clip/ratio_mean"] * n["valid"]
    out = {k: num[k] / den[pop] if den[pop] > 0 else 0.0 for k, pop in CLIP_FRACTIONS.items()}
    empty = den["valid"] == 0
    out.update({"clip/ratio_min": 0.0 if empty else rmin, "clip/ratio_max": 0.0 if empty else rmax,
                "clip/ratio_mean": 0.0 if empty else rsum / den["valid"]})
    bounds = {(m["clip/bound_low"], m["clip/bound_high"]) for m, _, _ in parts}
    if len(bounds) > 1:
        raise ValueError(f"pool_clip_metrics: micro-batches clipped with different bounds {sorted(bounds)}")
    if bounds:  # the bounds these micro-batches' loss used (one pair per step)
        out["clip/bound_low"], out["clip/bound_high"] = bounds.pop()
    return out


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum_v softmax(z)_v z_v``."""
    z = logits.detach().to(torch.float64)
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_metrics(
    mask: torch.Tensor, *, logits: torch.Tensor | None = None, logp: torch.Tensor | None = None
) -> dict[str, float]:
    """``policy/entropy`` on generated tokens: exact from ``logits`` [B,T,V], or the sampled estimate mean(-logp)."""
    if logits is not None:
        ent = token_entropy(logits)
    elif logp is not None:
        ent = -logp.detach().to(torch.float64)
    else:
        raise ValueError("entropy_metrics needs logits or logp")
    _check_same_shape(entropy=ent, mask=mask)
    return {"policy/entropy": float(masked_mean(ent, mask))}


def response_length_metrics(mask: torch.Tensor) -> dict[str, float]:
    """``response/length_mean`` and ``response/length_max``: valid tokens per sequence."""
    lengths = mask.to(torch.float64).sum(dim=-1)
    if lengths.numel() == 0:
        return {"response/length_mean": 0.0, "response/length_max": 0.0}
    return {"response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max())}
