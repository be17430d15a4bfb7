"""Calibrated Clipping: hand-computed bounds, the FP8-noise simulation, smoothing caps, search limits, resume."""
import dataclasses
import json

import pytest
import torch

from configs.schema import config_from_dict
from fp8core.rl import CalibratedClipping, CalibratedClippingConfig


def _cfg(ref="grpo", **calibration):
    """The recipe's Calibrated Clipping settings (schema defaults + these ``calibration.clip_*`` keys) with the BF16
    reference of GRPO [0.8, 1.24] or DAPO [0.8, 1.28]."""
    loss_fn = {"ratio_clip_min": 0.2, "ratio_clip_max": {"grpo": 0.24, "dapo": 0.28}[ref]}
    return config_from_dict({"loss_fn": loss_fn, "calibration": calibration}).calibrated_clipping_config()


def _hand_batch():
    # 4 negative-advantage tokens (A = -1) then 4 positive-advantage tokens (A = +1), one sequence each
    bf16 = torch.tensor([0.7, 0.9, 1.0, 1.1, 1.0, 1.3, 1.1, 1.5], dtype=torch.float64)
    fp8 = torch.tensor([0.55, 0.65, 0.95, 1.05, 1.0, 1.35, 1.1, 1.7], dtype=torch.float64)
    adv = torch.tensor([-1.0] * 4 + [1.0] * 4, dtype=torch.float64)
    return fp8, bf16, adv


def test_hand_computed_bounds_without_smoothing():
    # BF16 at [0.8, 1.24]: negative tokens below 0.8 -> {0.7}: fraction 1/4.
    # FP8 fraction below L is 1/4 exactly for L in (0.55, 0.65] -> grid {0.56, ..., 0.64}; closest to current 0.8: 0.64.
    # Silenced mass: BF16 M- = 0.7, M+ = 1.3 + 1.5 = 2.8 (share 0.8). FP8 at L = 0.64: M- = 0.55.
    # |M+_fp8(H) * 0.7 - 2.8 * 0.55|: H < 1.35 -> |3.05*0.7 - 1.54| = 0.595; 1.35 <= H < 1.7 -> |1.19 - 1.54| = 0.35;
    # H >= 1.7 -> 1.54. Best: H in {1.36, ..., 1.68}; closest to current 1.24: 1.36.
    cfg = _cfg(clip_init_low=0.8, clip_init_high=1.24, clip_max_delta_low=1.0, clip_max_delta_high=1.0)
    cc = CalibratedClipping(cfg)
    fp8, bf16, adv = _hand_batch()
    (low, high), d = cc.calibrate(20, fp8, bf16, adv)
    assert (low, high) == (0.64, 1.36)
    assert d["calib/bf16_lower_neg_frac"] == 0.25 and d["calib/fp8_lower_neg_frac_after"] == 0.25
    assert d["calib/fp8_lower_neg_frac_at_ref"] == 0.5  # FP8 noise doubles the failure signal at the BF16 bound
    assert d["calib/bf16_pos_mass_share"] == pytest.approx(0.8)
    assert d["calib/fp8_pos_mass_share_after"] == pytest.approx(1.7 / (1.7 + 0.55))
    assert cc.bounds == (0.64, 1.36)


def test_hand_computed_bounds_with_default_smoothing():
    # same batch from the default initial bounds [0.6, 1.8]: the L plateau {0.56, ..., 0.64} contains 0.6 itself, so
    # L* = 0.6 (no move); the H plateau {1.36, ..., 1.68} is reached at its top (closest to 1.8): H* = 1.68, and the
    # 0.1 smoothing cap stops H at 1.8 - 0.1 = 1.7.
    cc = CalibratedClipping(_cfg())
    fp8, bf16, adv = _hand_batch()
    (low, high), d = cc.calibrate(20, fp8, bf16, adv)
    assert d["calib/target_low"] == 0.6 and low == 0.6
    # with L = 0.6, M-_fp8 = 0.55 as before -> same plateau for H; closest to 1.8 is 1.68, within the 0.1 cap
    assert d["calib/target_high"] == 1.68 and high == 1.7


def test_token_and_sequence_layouts_agree():
    # [B, T] token ratios with padding == the flattened valid tokens as a 1-D (sequence-level style) input
    fp8, bf16, adv = _hand_batch()
    mask = torch.ones(2, 6)
    mask[:, 4:] = 0
    pad = lambda x, v: torch.cat([x.view(2, 4), torch.full((2, 2), v, dtype=x.dtype)], dim=1)  # noqa: E731
    cfg = _cfg(clip_init_low=0.8, clip_init_high=1.24, clip_max_delta_low=1.0, clip_max_delta_high=1.0)
    a = CalibratedClipping(cfg).calibrate(1, pad(fp8, 1e-6), pad(bf16, 1e6), torch.tensor([-1.0, 1.0]), mask)
    b = CalibratedClipping(cfg).calibrate(1, fp8, bf16, adv)
    assert a == b


def _simulate(seed, n=100_000, sigma_bf16=0.2, sigma_noise=0.15, level="token"):
    """BF16 ratios log-normal; FP8 = BF16 * exp(multiplicative noise), as FP8 rounding of both logprobs would give."""
    g = torch.Generator().manual_seed(seed)
    log_rb = sigma_bf16 * torch.randn(n, generator=g, dtype=torch.float64)
    log_rf = log_rb + sigma_noise * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return log_rf.exp(), log_rb.exp(), adv


def _neg_lower_frac(r, adv, low):
    neg = adv < 0
    return float((r[neg] < low).sum()) / int(neg.sum())


def _pos_share(r, adv, low, high):
    w = adv.abs() * r
    p = float(w[(adv > 0) & (r > high)].sum())
    m = float(w[(adv < 0) & (r < low)].sum())
    return p / (p + m)


@pytest.mark.parametrize("ref", ["grpo", "dapo"])
def test_noise_simulation_restores_bf16_lower_clip_fraction(ref):
    cfg = _cfg(ref)
    cc = CalibratedClipping(cfg)
    lows = []
    for k in range(1, 7):  # 6 calibrations (steps 20, 40, ...) on fresh batches; smoothing needs ~4 to travel 0.6 -> 0.76
        step = k * cfg.clip_period
        assert cc.should_calibrate(step)
        rf, rb, adv = _simulate(seed=k)
        cc.calibrate(step, rf, rb, adv)
        lows.append(cc.low)
    rf, rb, adv = _simulate(seed=999)  # held-out batch
    bf16 = _neg_lower_frac(rb, adv, cfg.ref_low)
    fp8_at_ref = _neg_lower_frac(rf, adv, cfg.ref_low)
    fp8_cal = _neg_lower_frac(rf, adv, cc.low)
    print(f"\n[{cfg.ref_eps_high}] bounds {cc.bounds} lows {lows}; neg lower-clip frac: bf16 {bf16:.4f}, "
          f"fp8@ref {fp8_at_ref:.4f}, fp8@calibrated {fp8_cal:.4f}; pos share bf16 "
          f"{_pos_share(rb, adv, cfg.ref_low, cfg.ref_high):.3f} fp8 {_pos_share(rf, adv, cc.low, cc.high):.3f}")
    assert fp8_at_ref > 1.2 * bf16  # the noise raises the failure signal ...
    assert abs(fp8_cal - bf16) <= 0.1 * bf16  # ... and the calibrated L brings it back within 10% of BF16's
    assert cc.high < cfg.clip_init_high
    assert abs(_pos_share(rf, adv, cc.low, cc.high) - _pos_share(rb, adv, cfg.ref_low, cfg.ref_high)) < 0.05


def test_noise_simulation_sequence_level_gspo():
    # GSPO: one ratio per sequence (much tighter), with GSPO-sized ranges and reference; same objectives
    cfg = CalibratedClippingConfig(clip_low_range=(0.99, 0.9998), clip_high_range=(1.0002, 1.01),
                                   clip_search_step=0.0002, clip_max_delta_low=1.0, clip_max_delta_high=1.0,
                                   clip_init_low=0.999, clip_init_high=1.001, ref_eps_low=0.003, ref_eps_high=0.004,
                                   clip_period=1)
    cc = CalibratedClipping(cfg)
    rf, rb, adv = _simulate(seed=5, n=50_000, sigma_bf16=0.002, sigma_noise=0.0015)
    cc.calibrate(1, rf, rb, adv)
    rf, rb, adv = _simulate(seed=6, n=50_000, sigma_bf16=0.002, sigma_noise=0.0015)
    bf16, fp8_at_ref = _neg_lower_frac(rb, adv, cfg.ref_low), _neg_lower_frac(rf, adv, cfg.ref_low)
    fp8_cal = _neg_lower_frac(rf, adv, cc.low)
    assert fp8_at_ref > 1.2 * bf16 and abs(fp8_cal - bf16) <= 0.1 * bf16, (bf16, fp8_at_ref, fp8_cal, cc.bounds)


def test_smoothing_caps_and_search_limits_respected():
    cfg = _cfg()
    cc = CalibratedClipping(cfg)
    prev = cc.bounds
    targets = []
    for k in range(1, 16):
        # very noisy FP8: the unconstrained L* would be far below 0.5 and H* far above 2 -> searched limits win
        rf, rb, adv = _simulate(seed=100 + k, n=5_000, sigma_bf16=0.1, sigma_noise=1.0)
        (low, high), d = cc.calibrate(k * 20, rf, rb, adv)
        targets.append((d["calib/target_low"], d["calib/target_high"]))
        assert abs(low - prev[0]) <= cfg.clip_max_delta_low + 1e-12
        assert abs(high - prev[1]) <= cfg.clip_max_delta_high + 1e-12
        assert cfg.clip_low_range[0] <= low <= cfg.clip_low_range[1]
        assert cfg.clip_high_range[0] <= high <= cfg.clip_high_range[1]
        prev = (low, high)
    assert all(cfg.clip_low_range[0] <= t[0] <= cfg.clip_low_range[1] for t in targets)
    assert all(cfg.clip_high_range[0] <= t[1] <= cfg.clip_high_range[1] for t in targets)
    assert cc.low == cfg.clip_low_range[0]  # pinned at the search limit
    # a target far away moves exactly by the cap: from 0.5 toward an almost-noise-free batch (L* ~ 0.8 >> 0.55)
    rf, rb, adv = _simulate(seed=7, n=20_000, sigma_bf16=0.2, sigma_noise=1e-4)
    (low, _), d = cc.calibrate(1000, rf, rb, adv)
    assert d["calib/target_low"] >= 0.78 and low == pytest.approx(0.55)


def test_state_dict_resume_continues_with_same_bounds():
    cfg = _cfg("dapo", clip_period=5)
    a = CalibratedClipping(cfg)
    rf, rb, adv = _simulate(seed=1, n=20_000)
    a.calibrate(5, rf, rb, adv)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = CalibratedClipping(cfg)
    b.load_state_dict(state)
    assert b.bounds == a.bounds and b.last_step == 5 and b.num_calibrations == 1
    # a checkpoint written before the config fields were renamed (its "config" record is never read back) loads alike
    old = CalibratedClipping(cfg)
    old.load_state_dict({**state, "config": {"interval": 5, "low_range": [0.5, 0.9], "init_low": 0.6}})
    assert old.bounds == b.bounds and old.last_step == 5 and old.num_calibrations == 1
    assert not b.should_calibrate(5) and not b.should_calibrate(7) and b.should_calibrate(10)
    rf, rb, adv = _simulate(seed=2, n=20_000)
    assert a.calibrate(10, rf, rb, adv) == b.calibrate(10, rf, rb, adv)
    with pytest.raises(ValueError, match="last_step"):
        b.load_state_dict({"low": 0.6, "high": 1.8, "num_calibrations": 0})
    with pytest.raises(ValueError, match="'high'"):
        b.load_state_dict({"low": 0.6, "high": 3.0, "last_step": None, "num_calibrations": 0})


def test_config_validation_names_field():
    # the dataclass checks its own fields (dataclasses.replace re-runs them), naming the field in the message
    with pytest.raises(ValueError, match=r"CalibratedClippingConfig\.clip_init_low"):
        dataclasses.replace(_cfg(), clip_init_low=0.95)
    with pytest.raises(ValueError, match=r"CalibratedClippingConfig\.clip_period"):
        dataclasses.replace(_cfg(), clip_period=0)
    with pytest.raises(ValueError, match=r"CalibratedClippingConfig\.clip_high_range"):
        dataclasses.replace(_cfg(), clip_high_range=(2.0, 1.2))
    with pytest.raises(TypeError):  # no defaults: the recipe schema is the one place of them
        CalibratedClippingConfig(clip_period=20)
    assert _cfg("grpo").ref_high == pytest.approx(1.24)
    assert _cfg("dapo").ref_high == pytest.approx(1.28)
    assert _cfg().grid("low")[[0, -1]].tolist() == [0.5, 0.9]
    assert len(_cfg().grid("high")) == 41


def test_ratio_error_amplification_hand_computed_and_masked():
    from fp8core.rl.calibrated_clipping import ratio_error_amplification

    # valid tokens: |dr| = 0.1, 0.2 -> 0.15; |dp| = 0.05, 0.05 -> 0.05; amplification 3.0. The third column is
    # padding with huge errors: it must not count.
    rf = torch.tensor([[1.0, 1.2, 9.0]])
    rb = torch.tensor([[1.1, 1.0, 0.0]])
    pf = torch.tensor([[0.50, 0.30, 1.0]])
    pb = torch.tensor([[0.45, 0.35, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    d = ratio_error_amplification(rf, rb, pf, pb, mask)
    assert d["calib/ratio_abs_err"] == pytest.approx(0.15)
    assert d["calib/prob_abs_err"] == pytest.approx(0.05)
    assert d["calib/ratio_error_amplification"] == pytest.approx(3.0)
    # no FP8 error in the probabilities: nothing to amplify (nan, not inf or 0)
    same = ratio_error_amplification(rf, rb, pb, pb, mask)
    assert torch.isnan(torch.tensor(same["calib/ratio_error_amplification"]))
    with pytest.raises(ValueError, match="one shape"):
        ratio_error_amplification(rf, rb, pf[:, :2], pb, mask)


def test_ratio_error_amplification_of_a_small_old_probability():
    # the same FP8 error on the probabilities is amplified ~1/p_old in the ratio: p_old = 0.1 (exact in both
    # precisions), p_new 0.2 in BF16 and 0.21 in FP8 -> |dp| = 0.01, |dr| = 0.1, amplification 10.
    from fp8core.rl.calibrated_clipping import ratio_error_amplification

    p_old = torch.tensor([0.1], dtype=torch.float64)
    pb, pf = torch.tensor([0.2], dtype=torch.float64), torch.tensor([0.21], dtype=torch.float64)
    d = ratio_error_amplification(pf / p_old, pb / p_old, pf, pb)
    assert d["calib/ratio_error_amplification"] == pytest.approx(10.0)


def test_calibrate_logs_ratio_error_amplification_with_probabilities():
    fp8, bf16, adv = _hand_batch()
    cfg = _cfg()
    _, without = CalibratedClipping(cfg).calibrate(20, fp8, bf16, adv)
    assert "calib/ratio_error_amplification" not in without
    pb = torch.full_like(fp8, 0.5)
    pf = pb + 0.01
    _, d = CalibratedClipping(cfg).calibrate(20, fp8, bf16, adv, prob_fp8=pf, prob_bf16=pb)
    expected = float((fp8 - bf16).abs().mean()) / 0.01
    assert d["calib/ratio_error_amplification"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="both"):
        CalibratedClipping(cfg).calibrate(20, fp8, bf16, adv, prob_fp8=pf)
