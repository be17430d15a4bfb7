"""Group-relative advantages (GRPO) and the DAPO dynamic-sampling filter.

Public API
----------
``grpo_advantages(rewards, *, group_size=None, normalize_std=True, eps=1e-6, std_correction=1) -> Tensor``
    GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. 3 outcome supervision):
    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the ``group_size`` responses of one prompt; with
    ``normalize_std=False`` the Dr. GRPO variant (Liu et al. 2025, arXiv:2503.20783) ``A_i = r_i - mean_g(r)``.
    ``std_correction=1`` is Bessel's correction (``torch.std``'s default, as TRL and NeMo RL use).
``dynamic_sampling_mask(rewards, *, group_size=None, atol=0.0, per_sample=False) -> BoolTensor``
    DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, eq. 11 constraint ``0 < |{correct}| < G``), generalised to
    real-valued rewards: keep a group iff ``max(r) - min(r) > atol`` (a group whose rewards are all equal has zero advantage
    everywhere and carries no gradient). Returns ``[num_prompts]`` (or ``[num_prompts * group_size]`` with ``per_sample``).

Rewards may be ``[num_prompts * group_size]`` (grouped contiguously: prompt 0's responses first; ``group_size`` required)
or ``[num_prompts, group_size]``. Outputs keep the input's shape. All computation is in float64 and cast back.
"""
from __future__ import annotations

import torch

__all__ = ["grpo_advantages", "dynamic_sampling_mask"]


def _as_groups(rewards: torch.Tensor, group_size: int | None) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} disagrees with rewards shape {tuple(rewards.shape)}")
        return rewards
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D or 2-D, got shape {tuple(rewards.shape)}")
    if group_size is None or group_size < 1:
        raise ValueError("group_size (>= 1) is required for 1-D rewards")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards length {rewards.numel()} is not a multiple of group_size={group_size}")
    return rewards.view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std_correction: int = 1,
) -> torch.Tensor:
    """Group-normalized GRPO advantages, same shape and dtype as ``rewards``.

    ``A_i = (r_i - mean_g r) / (std_g r + eps)`` (``normalize_std=True``) or ``A_i = r_i - mean_g r``.
    A group of identical rewards gets advantage 0 for every member (never NaN).
    """
    groups = _as_groups(rewards, group_size)
    g = groups.shape[1]
    x = groups.to(torch.float64)
    centered = x - x.mean(dim=1, keepdim=True)
    if normalize_std:
        if g - std_correction <= 0:
            raise ValueError(f"group_size={g} too small for std_correction={std_correction}")
        std = x.std(dim=1, keepdim=True, correction=std_correction)
        centered = centered / (std + eps)
    return centered.to(rewards.dtype if rewards.is_floating_point() else torch.float32).reshape(rewards.shape)


def dynamic_sampling_mask(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    atol: float = 0.0,
    per_sample: bool = False,
) -> torch.Tensor:
    """DAPO dynamic-sampling filter: True for groups to keep (rewards not all equal, ``max - min > atol``)."""
    groups = _as_groups(rewards, group_size).to(torch.float64)
    spread = groups.max(dim=1).values - groups.min(dim=1).values
    keep = spread > atol
    if per_sample:
        keep = keep.repeat_interleave(groups.shape[1])
        if rewards.dim() == 2:
            keep = keep.view(rewards.shape)
    return keep
