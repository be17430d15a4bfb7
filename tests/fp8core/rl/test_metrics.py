"""Metrics: worked examples, estimator correctness against exact divergences, batch-order invariance."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8core.rl import (
    clip_metrics,
    entropy_metrics,
    mismatch_metrics,
    response_length_metrics,
)
from fp8core.rl.metrics import is_metrics


def test_mismatch_worked_example():
    # d = logp_train - logp_rollout = [log 2, -log 2] (+ one padded token with garbage)
    train = torch.tensor([[math.log(2.0), -math.log(2.0), 5.0]])
    roll = torch.tensor([[0.0, 0.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(train, roll, mask)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(2.0)
    k3 = ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2  # = 0.25, symmetric for this pair
    assert m["mismatch/kl_k3_rollout_train"] == pytest.approx(k3)
    assert m["mismatch/kl_k3_train_rollout"] == pytest.approx(k3)

    def f(t):
        return 0.5 * (t * math.log(t) - (1 + t) * math.log((1 + t) / 2))

    assert m["mismatch/js"] == pytest.approx((f(2.0) + f(0.5)) / 2)
    assert all(isinstance(v, float) for v in m.values())
    none = mismatch_metrics(train, train, mask)
    assert none == {"mismatch/token_mult_prob_error": 1.0, "mismatch/kl_k3_train_rollout": 0.0,
                    "mismatch/kl_k3_rollout_train": 0.0, "mismatch/js": 0.0, "mismatch/max_abs_logp_diff": 0.0,
                    "mismatch/frac_abs_logp_diff_gt_1": 0.0, "mismatch/excess_share_abs_logp_diff_gt_1": 0.0}


def test_estimators_match_exact_divergences_in_expectation():
    # Tokens sampled from the rollout distribution q; weighting each vocab entry by q(x) gives the exact expectation.
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)  # train
    q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)  # rollout
    mean_of = lambda name: sum(  # noqa: E731
        q[i].item() * mismatch_metrics(p.log()[i].view(1, 1), q.log()[i].view(1, 1), torch.ones(1, 1))[name]
        for i in range(50))
    kl_qp = (q * (q / p).log()).sum().item()
    mid = (p + q) / 2
    js = 0.5 * (p * (p / mid).log()).sum().item() + 0.5 * (q * (q / mid).log()).sum().item()
    assert mean_of("mismatch/kl_k3_rollout_train") == pytest.approx(kl_qp, rel=1e-9)
    assert mean_of("mismatch/js") == pytest.approx(js, rel=1e-9)


def test_clip_metrics_worked_example():
    ratio = torch.tensor([[0.5, 1.0, 1.5, 0.7], [0.9, 1.3, 0.6, 9.0]])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    m = clip_metrics(ratio, adv, mask, clip_low=0.8, clip_high=1.2)
    assert m["clip/lower_neg_adv_frac"] == pytest.approx(2 / 4)  # 0.5, 0.7
    assert m["clip/upper_neg_adv_frac"] == pytest.approx(1 / 4)  # 1.5
    assert m["clip/lower_pos_adv_frac"] == pytest.approx(1 / 3)  # 0.6
    assert m["clip/upper_pos_adv_frac"] == pytest.approx(1 / 3)  # 1.3 (9.0 is padding)
    assert (m["clip/ratio_min"], m["clip/ratio_max"]) == pytest.approx((0.5, 1.5))
    assert m["clip/ratio_mean"] == pytest.approx((0.5 + 1 + 1.5 + 0.7 + 0.9 + 1.3 + 0.6) / 7)


def test_entropy_and_length():
    logits = torch.zeros(1, 2, 4)  # uniform over 4 -> entropy log 4
    logits[0, 1] = torch.tensor([0.0, -1e9, -1e9, -1e9])  # deterministic -> 0 (padding here anyway)
    mask = torch.tensor([[1.0, 0.0]])
    assert entropy_metrics(mask, logits=logits)["policy/entropy"] == pytest.approx(math.log(4))
    assert entropy_metrics(mask, logp=torch.tensor([[-2.0, -5.0]]))["policy/entropy"] == pytest.approx(2.0)
    lm = response_length_metrics(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]))
    assert lm["response/length_mean"] == 2.0 and lm["response/length_max"] == 3.0


def test_empty_selection_gives_zero_not_nan():
    z = torch.zeros(2, 3)
    m = {**mismatch_metrics(z, z, z), **clip_metrics(z + 1, torch.ones(2), z, clip_low=0.8, clip_high=1.2),
         **is_metrics(z, z, z)}
    assert all(math.isfinite(v) for v in m.values())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_metrics_invariant_to_batch_order(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    train = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    roll = train + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ratio = torch.exp(0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))
    perm = torch.randperm(B, generator=g)

    def all_metrics(i):
        return {**mismatch_metrics(train[i], roll[i], mask[i]),
                **clip_metrics(ratio[i], adv[i], mask[i], clip_low=0.8, clip_high=1.28),
                **is_metrics(ratio[i].clamp_max(1.2), ratio[i], mask[i]),
                **entropy_metrics(mask[i], logp=train[i]), **response_length_metrics(mask[i])}

    a, b = all_metrics(torch.arange(B)), all_metrics(perm)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-12, abs=1e-12), k


@pytest.mark.parametrize("seed", range(3))
def test_mismatch_and_clip_match_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 4
    roll = train + 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    ratio = torch.exp(0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64))
    toks = [(i, t) for i in range(4) for t in range(6) if mask[i, t] > 0]
    d = [train[i, t].item() - roll[i, t].item() for i, t in toks]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    m = mismatch_metrics(train, roll, mask)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(mean([math.exp(abs(x)) for x in d]), rel=1e-12)
    assert m["mismatch/kl_k3_rollout_train"] == pytest.approx(mean([math.exp(x) - 1 - x for x in d]), rel=1e-12)
    assert m["mismatch/kl_k3_train_rollout"] == pytest.approx(mean([math.exp(-x) - 1 + x for x in d]), rel=1e-12)
    js = [0.5 * (math.exp(x) * x - (1 + math.exp(x)) * math.log((1 + math.exp(x)) / 2)) for x in d]
    assert m["mismatch/js"] == pytest.approx(mean(js), rel=1e-9)
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(max(abs(x) for x in d), rel=1e-12)
    big = [x for x in d if abs(x) > 1.0]
    assert m["mismatch/frac_abs_logp_diff_gt_1"] == pytest.approx(len(big) / len(d), rel=1e-12)
    share = sum(math.exp(abs(x)) - 1 for x in big) / sum(math.exp(abs(x)) - 1 for x in d)
    assert m["mismatch/excess_share_abs_logp_diff_gt_1"] == pytest.approx(share, rel=1e-12)
    c = clip_metrics(ratio, adv, mask, clip_low=0.8, clip_high=1.2)
    neg = [(i, t) for i, t in toks if adv[i] < 0]
    pos = [(i, t) for i, t in toks if adv[i] > 0]
    frac = lambda sel, cond: sum(1 for i, t in sel if cond(ratio[i, t].item())) / len(sel) if sel else 0.0  # noqa: E731
    assert c["clip/lower_neg_adv_frac"] == pytest.approx(frac(neg, lambda r: r < 0.8))
    assert c["clip/upper_neg_adv_frac"] == pytest.approx(frac(neg, lambda r: r > 1.2))
    assert c["clip/lower_pos_adv_frac"] == pytest.approx(frac(pos, lambda r: r < 0.8))
    assert c["clip/upper_pos_adv_frac"] == pytest.approx(frac(pos, lambda r: r > 1.2))


def test_pool_clip_metrics_worked_example():
    """Pooling weights each micro-batch's fractions by its population (not a plain mean of fractions)."""
    from fp8core.rl import pool_clip_metrics

    lo, hi = 0.8, 1.2
    parts = []
    for ratio, adv, mask in [
        ([[1.0, 1.0], [1.0, 1.0]], [1.0, -1.0], [[1, 1], [1, 1]]),  # a first update: ratio exactly 1
        ([[0.5, 1.0, 1.5], [0.7, 1.3, 1.0]], [-1.0, 1.0], [[1, 1, 1], [1, 1, 0]]),
        ([[0.9, 0.6]], [-1.0], [[1, 1]]),
    ]:
        r, a, m = torch.tensor(ratio), torch.tensor(adv), torch.tensor(mask, dtype=torch.float32)
        parts.append((clip_metrics(r, a, m, clip_low=lo, clip_high=hi), a, m))
    later = pool_clip_metrics(parts[1:])
    # negative-advantage tokens: 0.5 (< L), 1.0, 1.5 (> H) | 0.9, 0.6 (< L) -> 2/5 below, 1/5 above
    assert later["clip/lower_neg_adv_frac"] == pytest.approx(2 / 5)  # a plain mean of (1/3, 1/2) would be 0.4167
    assert later["clip/upper_neg_adv_frac"] == pytest.approx(1 / 5)
    # positive-advantage tokens: 0.7 (< L), 1.3 (> H); the masked 1.0 does not count
    assert later["clip/lower_pos_adv_frac"] == pytest.approx(1 / 2)
    assert later["clip/upper_pos_adv_frac"] == pytest.approx(1 / 2)
    assert (later["clip/ratio_min"], later["clip/ratio_max"]) == (0.5, 1.5)
    assert later["clip/ratio_mean"] == pytest.approx(6.5 / 7)
    every = pool_clip_metrics(parts)  # the first update adds 2 negative and 2 positive tokens, none clipped
    assert every["clip/lower_neg_adv_frac"] == pytest.approx(2 / 7)
    assert every["clip/upper_pos_adv_frac"] == pytest.approx(1 / 4)
    assert every["clip/ratio_mean"] == pytest.approx(10.5 / 11)
    assert all(v == 0.0 for v in pool_clip_metrics([]).values())


def test_mismatch_tail_metrics_single_outlier_token():
    """One token off by 9 nats among 2,000 exact ones: the mean rises by ~4, and the tail metrics say it is one token."""
    train = torch.zeros(1, 2000, dtype=torch.float64)
    roll = train.clone()
    roll[0, 7] = 9.0  # the rollout gave this token e^9 times the trainer's probability
    mask = torch.ones_like(train)
    m = mismatch_metrics(train, roll, mask)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(1 + math.expm1(9.0) / 2000, rel=1e-12)
    assert m["mismatch/max_abs_logp_diff"] == 9.0
    assert m["mismatch/frac_abs_logp_diff_gt_1"] == pytest.approx(1 / 2000)
    assert m["mismatch/excess_share_abs_logp_diff_gt_1"] == 1.0
    mask[0, 7] = 0.0  # masked out: no mismatch left at all
    m = mismatch_metrics(train, roll, mask)
    assert m["mismatch/token_mult_prob_error"] == 1.0 and m["mismatch/max_abs_logp_diff"] == 0.0
    assert m["mismatch/excess_share_abs_logp_diff_gt_1"] == 0.0


def test_pooled_clip_metrics_carry_the_bounds_the_micro_batches_used():
    from fp8core.rl.metrics import clip_metrics, pool_clip_metrics

    g = torch.Generator().manual_seed(0)
    ratio, adv, mask = torch.exp(0.3 * torch.randn(4, 6, generator=g)), torch.randn(4, generator=g), torch.ones(4, 6)
    part = (clip_metrics(ratio, adv, mask, clip_low=0.7, clip_high=1.5), adv, mask)
    pooled = pool_clip_metrics([part, part])
    assert (pooled["clip/bound_low"], pooled["clip/bound_high"]) == (0.7, 1.5)
    assert "clip/bound_low" not in pool_clip_metrics([])  # a step that trained nothing used no bounds
    other = (clip_metrics(ratio, adv, mask, clip_low=0.8, clip_high=1.5), adv, mask)
    with pytest.raises(ValueError, match="different bounds"):
        pool_clip_metrics([part, other])
