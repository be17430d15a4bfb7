"""Clipped PG loss: worked examples (checkable on paper), a loop reference across seeds, and padding invariance."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8core.rl import LossAgg, RatioLevel, clipped_pg_loss


def _one_seq(ratios, adv, **kw):
    logp = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, metrics = clipped_pg_loss(logp, old, torch.tensor([adv], dtype=torch.float64), mask, **kw)
    return loss, metrics, logp


def test_token_ratio_worked_example_positive_advantage():
    # ratios [0.5, 1, 1.5] clamp to [0.8, 1, 1.2]; A = +1: per token max(-r, -clip r) = [-0.5, -1, -1.2]
    loss, m, logp = _one_seq([0.5, 1.0, 1.5], 1.0, clip_low=0.8, clip_high=1.2)
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 1.2) / 3)
    loss.backward()
    # d/dlogp of -r A / 3 = -r/3 where unclipped; the r=1.5 token is clipped (zero gradient); r=0.5 with A>0 is not
    assert logp.grad.tolist()[0] == pytest.approx([-0.5 / 3, -1 / 3, 0.0])
    assert m["clip/upper_pos_adv_frac"] == pytest.approx(1 / 3)
    assert m["clip/lower_pos_adv_frac"] == pytest.approx(1 / 3)
    assert m["clip/lower_neg_adv_frac"] == 0.0
    assert (m["clip/ratio_min"], m["clip/ratio_max"]) == pytest.approx((0.5, 1.5))
    assert m["clip/ratio_mean"] == pytest.approx(1.0)
    assert (m["clip/bound_low"], m["clip/bound_high"]) == (0.8, 1.2)


def test_token_ratio_worked_example_negative_advantage():
    # A = -1: max(r, clip r) = [0.8, 1, 1.5] -> mean 1.1; the r=0.5 token is clipped (zero grad)
    loss, m, logp = _one_seq([0.5, 1.0, 1.5], -1.0, clip_low=0.8, clip_high=1.2)
    assert loss.item() == pytest.approx((0.8 + 1.0 + 1.5) / 3)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 1 / 3, 1.5 / 3])
    assert m["clip/lower_neg_adv_frac"] == pytest.approx(1 / 3)
    assert m["clip/upper_neg_adv_frac"] == pytest.approx(1 / 3)


def test_dual_clip_worked_example():
    # A = -1, ratios [0.5, 1, 4], c = 3: [max(0.5,0.8), 1, min(max(4,1.2), 3)] = [0.8, 1, 3]
    loss, _, logp = _one_seq([0.5, 1.0, 4.0], -1.0, clip_low=0.8, clip_high=1.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((0.8 + 1.0 + 3.0) / 3)
    loss.backward()
    assert logp.grad.tolist()[0][2] == 0.0
    # dual clip never touches positive advantages
    loss_pos, _, _ = _one_seq([0.5, 1.0, 4.0], 1.0, clip_low=0.8, clip_high=1.2, dual_clip=3.0)
    assert loss_pos.item() == pytest.approx(-(0.5 + 1.0 + 1.2) / 3)


def test_sequence_ratio_gspo_worked_example():
    # s = (0.5 * 1 * 1.5) ** (1/3) = 0.75 ** (1/3) ~ 0.9086, inside [0.8, 1.2]: loss = -s A for every token
    s = 0.75 ** (1 / 3)
    loss, m, logp = _one_seq([0.5, 1.0, 1.5], 1.0, clip_low=0.8, clip_high=1.2, ratio_level="sequence")
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    # d(-s)/dlogp_t = -s / 3 for each token (gradient spread evenly over the sequence)
    assert logp.grad.tolist()[0] == pytest.approx([-s / 3] * 3)
    assert m["clip/ratio_min"] == pytest.approx(s) and m["clip/ratio_max"] == pytest.approx(s)
    # GSPO's own tight clip [0.95, 1.05]: A = -1 -> max(s, 0.95) = 0.95, clipped -> zero gradient
    loss, m, logp = _one_seq([0.5, 1.0, 1.5], -1.0, clip_low=0.95, clip_high=1.05, ratio_level=RatioLevel.SEQUENCE)
    assert loss.item() == pytest.approx(0.95)
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
    assert m["clip/lower_neg_adv_frac"] == 1.0


def test_kl_and_is_weights_worked_example():
    # one token, r = 1, A = 1, ref_logp - logp = log 2: k3 = 2 - log 2 - 1; IS weight 0.5 scales both terms
    logp = torch.zeros(1, 1, dtype=torch.float64)
    ref = torch.full_like(logp, math.log(2.0))
    k3 = 2.0 - math.log(2.0) - 1.0
    loss, m = clipped_pg_loss(logp, logp, torch.ones(1), torch.ones_like(logp), clip_low=0.8, clip_high=1.2,
                              ref_logp=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * k3)
    assert m["loss/reference_kl"] == pytest.approx(k3)
    loss, _ = clipped_pg_loss(logp, logp, torch.ones(1), torch.ones_like(logp), clip_low=0.8, clip_high=1.2,
                              ref_logp=ref, kl_coef=0.1, is_weights=torch.full_like(logp, 0.5))
    assert loss.item() == pytest.approx(0.5 * (-1.0 + 0.1 * k3))


def test_loss_aggregation_worked_example():
    # seq 0 has 1 valid token (loss -1), seq 1 has 3 valid tokens (losses -1, -2 (r=2 unclipped in [0.1, 10]), -1)
    logp = torch.log(torch.tensor([[1.0, 9.0, 9.0], [1.0, 2.0, 1.0]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0])
    kw = dict(clip_low=0.1, clip_high=10.0)
    expect = {
        "token_mean": (-1 - 1 - 2 - 1) / 4,
        "seq_mean_token_mean": (-1 + (-4 / 3)) / 2,
        "seq_mean_token_sum": (-1 + -4) / 2,
    }
    for agg, val in expect.items():
        loss, _ = clipped_pg_loss(logp, old, adv, mask, loss_agg=agg, **kw)
        assert loss.item() == pytest.approx(val), agg
    # explicit global normalizer (gradient accumulation): token_mean with 10 tokens in the global batch
    loss, _ = clipped_pg_loss(logp, old, adv, mask, loss_agg=LossAgg.TOKEN_MEAN, normalizer=10.0, **kw)
    assert loss.item() == pytest.approx(-5 / 10)


def test_bad_arguments_are_named():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_agg"):
        clipped_pg_loss(x, x, torch.ones(1), torch.ones_like(x), clip_low=0.8, clip_high=1.2, loss_agg="mean")
    with pytest.raises(ValueError, match="ratio_level"):
        clipped_pg_loss(x, x, torch.ones(1), torch.ones_like(x), clip_low=0.8, clip_high=1.2, ratio_level="seq")
    with pytest.raises(ValueError, match="clip_low"):
        clipped_pg_loss(x, x, torch.ones(1), torch.ones_like(x), clip_low=1.3, clip_high=1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_pg_loss(x, x, torch.ones(1), torch.ones_like(x), clip_low=0.8, clip_high=1.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="mask"):
        clipped_pg_loss(x, x, torch.ones(1), torch.ones(1, 3), clip_low=0.8, clip_high=1.2)


# ---------------------------------------------------------------- loop reference (python floats, float64 semantics)
def _reference_loss(logp, old, adv, mask, *, lo, hi, dual, level, agg, ref, kl_coef, w):
    B, T = len(logp), len(logp[0])
    per_tok = [[0.0] * T for _ in range(B)]
    for i in range(B):
        valid = [t for t in range(T) if mask[i][t] > 0]
        seq_r = math.exp(sum(logp[i][t] - old[i][t] for t in valid) / max(len(valid), 1))
        for t in valid:
            a = adv[i][t]
            r = math.exp(logp[i][t] - old[i][t]) if level == "token" else seq_r
            pg = max(-a * r, -a * min(max(r, lo), hi))
            if dual is not None and a < 0:
                pg = min(pg, -a * dual)
            kl = 0.0
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                kl = math.exp(d) - d - 1
            wt = 1.0 if w is None else w[i][t]
            per_tok[i][t] = wt * (pg + kl_coef * kl)
    if agg == "token_mean":
        n = sum(1 for i in range(B) for t in range(T) if mask[i][t] > 0)
        return sum(per_tok[i][t] for i in range(B) for t in range(T) if mask[i][t] > 0) / max(n, 1)
    vals = []
    for i in range(B):
        valid = [t for t in range(T) if mask[i][t] > 0]
        if not valid:
            continue
        s = sum(per_tok[i][t] for t in valid)
        vals.append(s / len(valid) if agg == "seq_mean_token_mean" else s)
    return sum(vals) / max(len(vals), 1)


def _random_batch(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return logp, old, ref, mask, adv, w


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_matches_loop_reference(seed):
    logp, old, ref, mask, adv, w = _random_batch(seed)
    combos = itertools.product(["token", "sequence"], [a.value for a in LossAgg], [None, 2.0], [False, True],
                               [False, True], [False, True])
    for level, agg, dual, use_kl, use_w, token_adv in combos:
        a = adv[:, None].expand_as(logp) + (0.1 * logp if token_adv else 0.0)
        got, _ = clipped_pg_loss(logp, old, a, mask, clip_low=0.85, clip_high=1.25, dual_clip=dual, ratio_level=level,
                                 loss_agg=agg, ref_logp=ref if use_kl else None, kl_coef=0.05,
                                 is_weights=w if use_w else None)
        want = _reference_loss(logp.tolist(), old.tolist(), a.tolist(), mask.tolist(), lo=0.85, hi=1.25, dual=dual,
                               level=level, agg=agg, ref=ref.tolist() if use_kl else None, kl_coef=0.05,
                               w=w.tolist() if use_w else None)
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12), (level, agg, dual, use_kl, use_w, token_adv)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), extra_cols=st.integers(1, 4), extra_rows=st.integers(0, 2),
       level=st.sampled_from(["token", "sequence"]), agg=st.sampled_from([a.value for a in LossAgg]))
def test_loss_unchanged_by_extra_padding(seed, extra_cols, extra_rows, level, agg):
    logp, old, ref, mask, adv, w = _random_batch(seed % 1000, B=3, T=4)
    kw = dict(clip_low=0.8, clip_high=1.28, ratio_level=level, loss_agg=agg, kl_coef=0.1, dual_clip=3.0)
    base, base_m = clipped_pg_loss(logp, old, adv, mask, ref_logp=ref, is_weights=w, **kw)
    B, T = logp.shape

    def pad(x, value):
        x = torch.cat([x, torch.full((B, extra_cols), value, dtype=x.dtype)], dim=1)
        return torch.cat([x, torch.full((extra_rows, T + extra_cols), value, dtype=x.dtype)], dim=0)

    # garbage (inf / nan / huge) in the padding must not leak into the loss or its gradient
    logp_p = pad(logp, float("-inf")).requires_grad_(True)
    padded, padded_m = clipped_pg_loss(logp_p, pad(old, 50.0), torch.cat([adv, torch.full((extra_rows,), 7.0,
                                       dtype=adv.dtype)]), pad(mask, 0.0), ref_logp=pad(ref, float("nan")),
                                       is_weights=pad(w, 1e9), **kw)
    assert padded.item() == pytest.approx(base.item(), rel=1e-12, abs=1e-12)
    padded.backward()
    assert torch.isfinite(logp_p.grad).all() and (logp_p.grad[:, T:] == 0).all()
    for k in ("clip/lower_neg_adv_frac", "clip/upper_pos_adv_frac", "clip/ratio_mean", "loss/reference_kl"):
        assert padded_m[k] == pytest.approx(base_m[k], rel=1e-12, abs=1e-12)


def test_reference_kl_estimators_and_clamps_by_hand():
    import math

    from fp8core.rl.losses import reference_kl

    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    assert reference_kl(logp, ref, "k1").tolist() == pytest.approx(d)
    assert reference_kl(logp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in d])
    assert reference_kl(logp, ref, "k3").tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d])
    assert reference_kl(logp, ref, "k1", input_clamp=0.25).tolist() == pytest.approx([0.25, -0.25, 0.0])
    assert reference_kl(logp, ref, "k3", output_clamp=0.5).tolist() == pytest.approx(
        [math.exp(-0.5) - 0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match="kl_type"):
        reference_kl(logp, ref, "k4")


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_loss_adds_the_chosen_kl_times_its_coefficient(kl_type):
    from fp8core.rl.losses import reference_kl

    logp = torch.tensor([[-1.0, -2.0, -0.7]], requires_grad=True)
    old, ref, adv = logp.detach().clone(), torch.tensor([[-1.2, -1.5, -0.7]]), torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    base, _ = clipped_pg_loss(logp, old, adv, mask, clip_low=0.8, clip_high=1.28)
    loss, m = clipped_pg_loss(logp, old, adv, mask, clip_low=0.8, clip_high=1.28, ref_logp=ref, kl_coef=0.1,
                              kl_type=kl_type)
    kl = reference_kl(logp.detach(), ref, kl_type)[0, :2].mean()
    assert float(loss) == pytest.approx(float(base) + 0.1 * float(kl))
    assert m["loss/reference_kl"] == pytest.approx(float(kl))
