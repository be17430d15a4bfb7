"""GRPO advantages and the DAPO dynamic-sampling mask: worked examples and a loop reference."""
import math

import pytest
import torch

from fp8core.rl import dynamic_sampling_mask, grpo_advantages


def test_grpo_worked_example():
    # group [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]; group [0, 0, 0] -> zeros (never NaN)
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    a = grpo_advantages(r, group_size=3, eps=0.0 + 1e-12)
    assert a.tolist() == pytest.approx([-1, 0, 1, 0, 0, 0], abs=1e-9)
    assert grpo_advantages(r, group_size=3, normalize_std=False).tolist() == pytest.approx([-1, 0, 1, 0, 0, 0])
    # 2-D input keeps its shape; population std (correction 0): std of [1, 3] = 1
    a2 = grpo_advantages(torch.tensor([[1.0, 3.0]]), std_correction=0, eps=0.0)
    assert a2.shape == (1, 2) and a2.tolist() == [[-1.0, 1.0]]


def test_grpo_matches_loop_reference():
    g = torch.Generator().manual_seed(3)
    r = torch.rand(4, 6, generator=g, dtype=torch.float64)
    got = grpo_advantages(r.flatten(), group_size=6, eps=1e-6)
    for i in range(4):
        row = r[i].tolist()
        mu = sum(row) / 6
        sd = math.sqrt(sum((x - mu) ** 2 for x in row) / 5)
        for j in range(6):
            assert got[i * 6 + j].item() == pytest.approx((row[j] - mu) / (sd + 1e-6), rel=1e-12)


def test_dynamic_sampling_mask():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    assert dynamic_sampling_mask(r, group_size=3).tolist() == [False, True, False]
    assert dynamic_sampling_mask(r, group_size=3, per_sample=True).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert dynamic_sampling_mask(torch.tensor([[0.0, 0.01]]), atol=0.1).tolist() == [False]


def test_bad_shapes_named():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        dynamic_sampling_mask(torch.zeros(4))
