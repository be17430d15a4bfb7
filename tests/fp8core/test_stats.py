"""fp8core.stats: hand-worked pass@k / Wilson values, exact-rational references, bootstrap coverage on synthetic
paired data with a known effect."""
from fractions import Fraction
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8core.stats import (
    Estimate,
    accuracy_estimate,
    avg_at_k_per_prompt,
    bootstrap_mean,
    paired_bootstrap,
    pass_at_k,
    pass_at_k_per_prompt,
    sample_estimates,
    wilson_interval,
)


def test_pass_at_k_worked_examples():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 4) == pytest.approx(5 / 6)  # 1 - C(7,4)/C(10,4) = 1 - 35/210
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c / n
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k: every 2-subset holds a correct sample
    assert pass_at_k(8, 0, 8) == 0.0
    # the naive 1 - (1 - c/n)^k is biased: 1 - 0.75^2 = 0.4375 != 0.5
    assert abs(pass_at_k(4, 1, 2) - (1 - 0.75 ** 2)) > 0.05


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 60), data=st.data())
def test_pass_at_k_equals_the_exact_binomial_ratio(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    if k > 1:  # more tries never lower pass@k
        assert pass_at_k(n, c, k) >= pass_at_k(n, c, k - 1) - 1e-15
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match="n >= k"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="outside"):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="0/1"):
        pass_at_k_per_prompt(np.array([[0, 2]]), 1)


def test_per_prompt_matrix_estimates():
    m = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    assert pass_at_k_per_prompt(m, 2).tolist() == pytest.approx([0.5, 1 - 1 / 6, 0.0, 1.0])
    assert avg_at_k_per_prompt(m, 2).tolist() == [0.25, 0.5, 0.0, 1.0]
    est = sample_estimates(m, [1, 4], n_boot=500)
    assert est["avg@4"].value == pytest.approx(1.75 / 4)
    assert est["pass@1"].value == pytest.approx(est["avg@1"].value)
    assert est["pass@4"].value == pytest.approx(0.75)
    for e in est.values():
        assert e.lo <= e.value <= e.hi


def test_wilson_published_values():
    # Wilson score 95% intervals (e.g. Newcombe 1998, Table I; any statistics package)
    lo, hi = wilson_interval(8, 10)
    assert (lo, hi) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)
    e = accuracy_estimate([True] * 142 + [False] * 358)  # 0.284 on 500 prompts
    assert e.value == pytest.approx(0.284) and e.lo == pytest.approx(0.2459, abs=5e-4)
    assert e.hi == pytest.approx(0.3255, abs=5e-4) and e.n == 500
    with pytest.raises(ValueError):
        wilson_interval(3, 0)


def test_bootstrap_mean_matches_the_normal_interval_on_large_samples():
    rng = np.random.default_rng(1)
    x = rng.random(2000)
    e = bootstrap_mean(x, n_boot=4000, seed=3)
    half = 1.959964 * x.std(ddof=1) / np.sqrt(x.size)  # float64 reference
    assert e.value == pytest.approx(x.mean())
    assert (e.hi - e.lo) / 2 == pytest.approx(half, rel=0.08)
    assert bootstrap_mean(x, n_boot=500, seed=3) == bootstrap_mean(x, n_boot=500, seed=3)  # seeded


def test_paired_bootstrap_worked_examples():
    e = paired_bootstrap([0, 0, 1, 1], [1, 0, 1, 1], n_boot=2000)
    assert e.value == pytest.approx(0.25) and 0.0 <= e.lo < 0.25 < e.hi <= 1.0
    const = paired_bootstrap(np.zeros((3, 50)), np.full((3, 50), 0.2))  # every prompt gains 0.2: no spread
    assert (const.value, const.lo, const.hi) == pytest.approx((0.2, 0.2, 0.2))
    assert const.n == 150 and const.seed_sd == pytest.approx(0.0)
    two = paired_bootstrap([np.zeros(4), np.zeros(6)], [np.ones(4), np.zeros(6)], shared_prompts=False)
    assert two.value == pytest.approx(0.5)  # mean of the seed means (1.0, 0.0), not of the 10 prompts
    assert two.seed_sd == pytest.approx(np.std([1.0, 0.0], ddof=1))
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap([0, 1, 1], [1, 1])
    with pytest.raises(ValueError, match="shared_prompts"):
        paired_bootstrap([np.zeros(4), np.zeros(6)], [np.ones(4), np.zeros(6)])
    with pytest.raises(ValueError, match="seed strata"):
        paired_bootstrap(np.zeros((2, 5)), np.zeros((3, 5)))


def _synthetic(rng, *, seeds, prompts, effect, prompt_sd=1.5):
    """0/1 per-prompt correctness of two arms on the same prompts: a prompt's difficulty is shared by both arms and
    all seeds (logit scale), arm b adds ``effect`` to the success probability."""
    diff = rng.normal(0, prompt_sd, prompts)
    pa = 1 / (1 + np.exp(-diff))
    pb = np.clip(pa + effect, 0, 1)
    a = (rng.random((seeds, prompts)) < pa).astype(float)
    b = (rng.random((seeds, prompts)) < pb).astype(float)
    return a, b, float(pb.mean() - pa.mean())


@pytest.mark.parametrize("effect", [0.0, -0.05, 0.25])
def test_paired_bootstrap_covers_a_known_effect(effect):
    """Over many synthetic experiments (3 seeds x 200 prompts, the true per-prompt effect known), the 95% interval
    contains the true mean difference about 95% of the time (finite-sample slack: 88-99%)."""
    rng = np.random.default_rng(7)
    trials, hits = 150, 0
    for t in range(trials):
        a, b, true = _synthetic(rng, seeds=3, prompts=200, effect=effect)
        e = paired_bootstrap(a, b, n_boot=800, seed=t)
        hits += e.lo <= true <= e.hi
    assert 0.88 <= hits / trials <= 0.99, hits / trials


def test_shared_prompt_resampling_keeps_cross_seed_correlation():
    """When a prompt's difference repeats across seeds (arm b is systematically wrong on some prompts), resampling
    each seed independently understates the interval; the shared resampling does not."""
    rng = np.random.default_rng(0)
    bad = rng.random(100) < 0.3  # b loses these prompts in every seed
    a = np.ones((3, 100))
    b = np.where(bad, 0.0, 1.0)[None, :].repeat(3, axis=0)
    shared = paired_bootstrap(a, b, n_boot=3000)
    indep = paired_bootstrap(list(a), list(b), n_boot=3000, shared_prompts=False)
    assert shared.value == indep.value == pytest.approx(-bad.mean())
    w_shared, w_indep = shared.hi - shared.lo, indep.hi - indep.lo
    assert w_shared == pytest.approx(w_indep * np.sqrt(3), rel=0.15)  # 3 perfectly correlated seeds = 1 seed
    one = paired_bootstrap(a[0], b[0], n_boot=3000)
    assert w_shared == pytest.approx(one.hi - one.lo, rel=0.1)


def test_estimate_formatting():
    e = Estimate(0.412, 0.369, 0.456, 500)
    assert e.fmt() == "0.412 [0.369, 0.456]"
    assert e.as_dict()["n"] == 500


def test_drop_test_plan_and_seeds_needed_hand_worked():
    from fp8core.stats import drop_test_plan, seeds_needed

    p = drop_test_plan(se=0.02, effect=0.05)  # t = 0.05 - 0.8416 * 0.02; false fail = 1 - Phi(t / 0.02)
    assert p.threshold == pytest.approx(0.05 - 0.841621 * 0.02, abs=1e-6)
    assert p.power == 0.8 and p.false_fail == pytest.approx(0.0486, abs=5e-4)
    assert seeds_needed(sd_per_seed=0.05, effect=0.05) == 7  # (2.4865)^2 = 6.18
    assert seeds_needed(sd_per_seed=0.02, effect=0.05) == 1
    with pytest.raises(ValueError):
        drop_test_plan(se=0.0, effect=0.05)
