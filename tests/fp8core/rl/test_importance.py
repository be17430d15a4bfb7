"""IS weights: worked examples for TIS / ICE-POP / seq-mask-TIS, detachment, and weight = 1 when logprobs agree."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8core.rl import ISKind, icepop_weights, importance_weights, seq_mask_tis_weights, tis_weights


def _pair(rhos):
    """rollout logp = 0, old logp = log rho -> raw ratio rho."""
    old = torch.log(torch.tensor(rhos, dtype=torch.float32))
    return old, torch.zeros_like(old)


def test_tis_worked_example():
    old, roll = _pair([[0.5, 1.0, 3.0]])
    mask = torch.ones_like(old)
    assert tis_weights(old, roll, mask, cap=2.0).tolist()[0] == pytest.approx([0.5, 1.0, 2.0])
    w, m = importance_weights(old, roll, mask, kind="tis")  # default C = 2
    assert w.tolist()[0] == pytest.approx([0.5, 1.0, 2.0])
    assert m["is/weight_mean"] == pytest.approx(3.5 / 3)
    assert m["is/weight_max"] == pytest.approx(2.0)
    assert m["is/frac_truncated"] == pytest.approx(1 / 3)


def test_icepop_worked_example():
    old, roll = _pair([[0.5, 1.0, 3.0, 0.6]])
    mask = torch.ones_like(old)
    w = icepop_weights(old, roll, mask, low=0.6, high=2.5)
    assert w.tolist()[0] == pytest.approx([0.0, 1.0, 0.0, 0.6])
    w, m = importance_weights(old, roll, mask, kind=ISKind.ICE_POP, low=0.6, high=2.5)
    assert m["is/frac_truncated"] == pytest.approx(2 / 4)
    assert m["is/weight_max"] == pytest.approx(1.0)


def test_seq_mask_tis_worked_example():
    # seq 0: token ratios [2, 0.5] -> geometric mean 1 -> kept, TIS weights [min(2, 1.5), 0.5] = [1.5, 0.5]
    # seq 1: [1.1, 1.1] -> geometric mean 1.1 > 1.05 -> masked
    # seq 2: [0.9, 0.99, pad] -> geometric mean sqrt(0.891) ~ 0.944 inside [0.9, 1.05] -> kept
    old, roll = _pair([[2.0, 0.5, 1.0], [1.1, 1.1, 1.0], [0.9, 0.99, 123.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.float32)
    w = seq_mask_tis_weights(old, roll, mask, low=0.9, high=1.05, cap=1.5)
    assert w.tolist() == [pytest.approx([1.5, 0.5, 0.0]), pytest.approx([0.0, 0.0, 0.0]), pytest.approx([0.9, 0.99, 0])]
    _, m = importance_weights(old, roll, mask, kind="seq_mask_tis", low=0.9, high=1.05, cap=1.5)
    # truncated: token 0 of seq 0 (clamped) and both tokens of seq 1 (masked) out of 6 valid tokens
    assert m["is/frac_truncated"] == pytest.approx(3 / 6)


def test_weights_are_detached_and_padding_is_zero():
    old = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    roll = torch.tensor([[-1.5, -2.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for kind in ISKind:
        w, _ = importance_weights(old, roll, mask, kind=kind, low=0.1, high=10.0)
        assert not w.requires_grad
        assert w[0, 2].item() == 0.0 and torch.isfinite(w).all()
    assert tis_weights(old, roll, mask).tolist()[0][:2] == pytest.approx([math.exp(0.5), 1.0])


def test_unknown_kind_is_named():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="kind"):
        importance_weights(x, x, torch.ones_like(x), kind="tis2")


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(list(ISKind)))
def test_weight_is_one_when_logprobs_agree(seed, kind):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g) * 10
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    w, m = importance_weights(logp, logp.clone(), mask, kind=kind)
    assert torch.equal(w, mask)
    if mask.sum() > 0:
        assert m["is/weight_mean"] == 1.0 and m["is/weight_max"] == 1.0 and m["is/frac_truncated"] == 0.0


def _loop_weights(old, roll, mask, kind, cap, low, high):
    out = []
    for o_row, r_row, m_row in zip(old, roll, mask, strict=True):
        valid = [t for t, m in enumerate(m_row) if m > 0]
        rho = [math.exp(o - r) for o, r in zip(o_row, r_row, strict=True)]
        geo = math.exp(sum(o_row[t] - r_row[t] for t in valid) / max(len(valid), 1))
        row = []
        for t in range(len(m_row)):
            if t not in valid:
                row.append(0.0)
            elif kind == "tis":
                row.append(min(rho[t], cap))
            elif kind == "icepop":
                row.append(rho[t] if low <= rho[t] <= high else 0.0)
            else:
                row.append(min(rho[t], cap) if low <= geo <= high else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_matches_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    old = roll + 0.5 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    old[0] = roll[0] + 0.01  # a sequence inside the seq-mask band
    mask = (torch.rand(6, 5, generator=g) > 0.25).to(torch.float64)
    for kind, cap, low, high in [("tis", 1.5, None, None), ("icepop", 2.0, 0.7, 1.6), ("seq_mask_tis", 1.5, 0.9, 1.1)]:
        w, _ = importance_weights(old, roll, mask, kind=kind, cap=cap, low=low, high=high)
        want = _loop_weights(old.tolist(), roll.tolist(), mask.tolist(), kind, cap, low, high)
        assert w.tolist() == [pytest.approx(row, rel=1e-6) for row in want], kind
