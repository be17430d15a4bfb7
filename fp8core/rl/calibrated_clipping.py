"""Calibrated Clipping: re-derive the PPO clip bounds [L, H] for an FP8 policy from a BF16 shadow of the same update.

Source: "Towards Full Pipeline FP8 Reinforcement Learning for LLMs" (Calibrated Clipping). FP8 forward passes add roughly
multiplicative noise to the importance ratio ``r = pi_theta / pi_old``; with the BF16 bounds ``[1 - eps_low, 1 + eps_high]``
more tokens land beyond the bounds, and in particular more negative-advantage tokens fall below ``1 - eps_low`` where the
PPO min zeroes their gradient (the paper's failure signal, ``clip/lower_neg_adv_frac``). Every ``clip_period`` steps the
trainer runs a BF16 forward of the master weights for the old and current policy (forward only) next to its FP8 forward;
the two ratio sets on the same tokens, with the advantages, give new bounds.

Public API
----------
``CalibratedClippingConfig`` (frozen dataclass, keyword-only, every field required): ``clip_period``,
``clip_low_range``, ``clip_high_range``, ``clip_search_step``, ``clip_max_delta_low``, ``clip_max_delta_high``,
``clip_init_low``, ``clip_init_high`` (the recipe's ``calibration.clip_*`` keys, same names) and ``ref_eps_low``,
``ref_eps_high`` (the BF16 reference ``loss_fn.ratio_clip_min`` / ``ratio_clip_max``). A run builds it with
``configs.schema.Config.calibrated_clipping_config()``; the defaults live only in the recipe schema
(configs/sections.py, ``CalibrationCfg`` and ``LossFnCfg``).
``CalibratedClipping(config)`` (config required): ``.bounds -> (L, H)``, ``.should_calibrate(step) -> bool``,
``.calibrate(step, ratio_fp8, ratio_bf16, advantages, mask=None, *, prob_fp8=None, prob_bf16=None) -> ((L, H),
diagnostics)``, ``ratio_error_amplification(...)`` (diagnostic, below),
``.state_dict() -> dict`` (plain floats/ints, JSON-safe), ``.load_state_dict(d)``.

Inputs: token level (GRPO/DAPO) ``ratio_* [B, T]`` with ``mask [B, T]`` and ``advantages [B]`` or ``[B, T]``; sequence
level (GSPO, beyond the paper) ``ratio_* [N]`` (one ratio per sequence), ``advantages [N]``, ``mask [N]`` or None. For
GSPO give the config GSPO-sized ranges/search step/reference (e.g. eps ~ 3e-4); the objectives are unchanged.

Objectives (grid search over ``G_L = {clip_low_range[0] + k*clip_search_step} ∩ clip_low_range``, ``G_H`` likewise;
"r < L" and "r > H" strict)
-------------------------------------------------------------------------------------------------------------------------
Let ``N`` = valid tokens with ``A < 0``, ``P`` = valid tokens with ``A > 0``, ``L_ref = 1 - ref_eps_low``,
``H_ref = 1 + ref_eps_high``.

lower (the paper's rule):
    ``L* = argmin_{L in G_L} | #{t in N: r_fp8 < L} / |N|  -  #{t in N: r_bf16 < L_ref} / |N| |``
    i.e. FP8 with L clips the same fraction of negative-advantage tokens as BF16 does with ``1 - eps``.

upper (our choice; the paper only says "balance"): the clipped *update mass* of a token is ``|A| r`` — the weight
``d(r A)/d log pi`` it would have carried in the gradient had it not been clipped. With
``M+_x(H) = sum_{t in P, r_x > H} A r_x`` (positive-advantage mass silenced at the upper bound) and
``M-_x(L) = sum_{t in N, r_x < L} |A| r_x`` (negative-advantage mass silenced at the lower bound), BF16's balance is the
positive share ``M+_bf16(H_ref) / (M+_bf16(H_ref) + M-_bf16(L_ref))``. We choose
    ``H* = argmin_{H in G_H} | M+_fp8(H) * M-_bf16(L_ref)  -  M+_bf16(H_ref) * M-_fp8(L_new) | / (S_fp8 * S_bf16)``
(``S_x = sum_valid |A| r_x``, a scale that makes the value comparable across batches and leaves the argmin unchanged),
which is the cross-multiplied form of "FP8's positive share at [L_new, H] = BF16's positive share at [L_ref, H_ref]".
Why: the sign balance of the silenced update mass sets which way clipping biases the step — silencing positive mass
(upper clip) stops probabilities of good tokens from growing (entropy falls, exploitation slows: DAPO's clip-higher tunes
exactly this), silencing negative mass (lower clip) stops bad tokens from being pushed down. L has already been matched to
BF16's token fraction, so H is chosen to restore BF16's direction of the clipping bias rather than an absolute count that
FP8 noise inflates on both sides. Mass (not counts) weighs tokens by how much update they would have carried. The
cross-multiplied form has no division, so it stays defined when one side has no clipped mass; when BF16 clips nothing at
all every H ties and H stays where it is (no information, no change).
``L_new`` is the smoothed lower bound that will actually be used together with H.

Ratio-error amplification (diagnostic, the paper's "FP8 error is amplified in the ratio")
-----------------------------------------------------------------------------------------
``ratio_error_amplification(ratio_fp8, ratio_bf16, prob_fp8, prob_bf16, mask)`` =
``mean_t |r_fp8 - r_bf16| / mean_t |p_fp8 - p_bf16|`` over the valid tokens, where ``p`` are the token probabilities
of the current (updated) policy on the sampled tokens in FP8 and in its BF16 shadow, and ``r = p / p_old`` the PPO
ratios, each computed with its own precision's old and new forward. A ratio divides two FP8-noisy probabilities, so
its absolute error exceeds the probabilities' (for small ``p`` by about ``1 / p_old``): values > 1 say how much the
clip decision sees more FP8 noise than the probabilities themselves carry (the paper measures 1.65-2.9x). ``nan``
when FP8 and BF16 probabilities agree exactly (no FP8 error to amplify). ``CalibratedClipping.calibrate`` logs it as
``calib/ratio_error_amplification`` (with ``calib/ratio_abs_err`` and ``calib/prob_abs_err``) when given the
probabilities.

ties: among equal objective values the grid point closest to the current bound wins (smallest change), then the smaller.
smoothing: ``L_new = clamp(L + clamp(L* - L, ±clip_max_delta_low), clip_low_range)``, ``H_new`` likewise with
``clip_max_delta_high`` and ``clip_high_range``.
No negative- (positive-) advantage tokens in the batch: L (H) is left unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["CalibratedClippingConfig", "CalibratedClipping", "ratio_error_amplification"]

_ROUND = 12  # decimals kept on bounds (grid points are exact decimals, not 0.6000000000000001)


@dataclass(frozen=True, kw_only=True)
class CalibratedClippingConfig:
    """Calibrated Clipping's settings; no defaults here (configs/sections.py's ``CalibrationCfg`` holds them): build it
    with ``configs.schema.Config.calibrated_clipping_config()``."""

    clip_period: int  # calibrate every clip_period steps
    clip_low_range: tuple[float, float]  # search range of L
    clip_high_range: tuple[float, float]  # search range of H
    clip_search_step: float  # grid step of both searches
    clip_max_delta_low: float  # smoothing: largest change of L per calibration
    clip_max_delta_high: float  # smoothing: largest change of H per calibration
    clip_init_low: float  # bounds used until the first calibration
    clip_init_high: float
    ref_eps_low: float  # BF16 reference bounds [1 - ref_eps_low, 1 + ref_eps_high]
    ref_eps_high: float

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"CalibratedClippingConfig.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.clip_period, int) or self.clip_period < 1:
            bad("clip_period", "must be an int >= 1")
        for name in ("clip_low_range", "clip_high_range"):
            rng = getattr(self, name)
            if len(rng) != 2 or not 0 < rng[0] < rng[1]:
                bad(name, "must be (min, max) with 0 < min < max")
            object.__setattr__(self, name, (float(rng[0]), float(rng[1])))
        if self.clip_low_range[1] >= self.clip_high_range[0]:
            bad("clip_low_range", "must lie below clip_high_range")
        for name in ("clip_search_step", "clip_max_delta_low", "clip_max_delta_high"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0")
        if not self.clip_low_range[0] <= self.clip_init_low <= self.clip_low_range[1]:
            bad("clip_init_low", f"must be inside clip_low_range {self.clip_low_range}")
        if not self.clip_high_range[0] <= self.clip_init_high <= self.clip_high_range[1]:
            bad("clip_init_high", f"must be inside clip_high_range {self.clip_high_range}")
        if not 0 < self.ref_eps_low < 1:
            bad("ref_eps_low", "must be in (0, 1)")
        if not self.ref_eps_high > 0:
            bad("ref_eps_high", "must be > 0")

    @property
    def ref_low(self) -> float:
        return 1.0 - self.ref_eps_low

    @property
    def ref_high(self) -> float:
        return 1.0 + self.ref_eps_high

    def grid(self, which: str) -> torch.Tensor:
        """Candidate bounds for ``which`` in {"low", "high"} (float64, inclusive of both ends when on the step)."""
        lo, hi = self.clip_low_range if which == "low" else self.clip_high_range
        n = int((hi - lo) / self.clip_search_step + 1e-9) + 1
        vals = [round(lo + k * self.clip_search_step, _ROUND) for k in range(n)]
        return torch.tensor(vals, dtype=torch.float64)


def _flatten(ratio_fp8, ratio_bf16, advantages, mask):
    if ratio_fp8.shape != ratio_bf16.shape:
        raise ValueError(f"ratio_bf16 shape {tuple(ratio_bf16.shape)} != ratio_fp8 shape {tuple(ratio_fp8.shape)}")
    if ratio_fp8.dim() not in (1, 2):
        raise ValueError(f"ratio_fp8 must be [N] (sequence level) or [B, T] (token level), got {tuple(ratio_fp8.shape)}")
    adv = advantages
    if ratio_fp8.dim() == 2 and adv.dim() == 1:
        adv = adv[:, None].expand_as(ratio_fp8)
    if adv.shape != ratio_fp8.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} incompatible with ratio shape "
                         f"{tuple(ratio_fp8.shape)}")
    if mask is None:
        f64 = lambda x: x.detach().to(torch.float64).reshape(-1)  # noqa: E731
        return f64(ratio_fp8), f64(ratio_bf16), f64(adv)
    valid = mask.bool()
    if valid.shape != ratio_fp8.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != ratio shape {tuple(ratio_fp8.shape)}")
    f64 = lambda x: x.detach().to(torch.float64)[valid]  # noqa: E731
    return f64(ratio_fp8), f64(ratio_bf16), f64(adv)


def ratio_error_amplification(
    ratio_fp8: torch.Tensor,
    ratio_bf16: torch.Tensor,
    prob_fp8: torch.Tensor,
    prob_bf16: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """``mean |r_fp8 - r_bf16| / mean |p_fp8 - p_bf16|`` over valid tokens (module docstring); all four tensors are
    ``[B, T]`` (or ``[N]``) on the same tokens, ``mask`` marks the valid ones (None = all). Returns
    ``{"calib/ratio_error_amplification", "calib/ratio_abs_err", "calib/prob_abs_err"}`` (the first ``nan`` when the
    probabilities agree exactly, or there is no valid token)."""
    shapes = {tuple(t.shape) for t in (ratio_fp8, ratio_bf16, prob_fp8, prob_bf16)}
    if len(shapes) != 1:
        raise ValueError(f"ratio_error_amplification: ratios and probabilities must have one shape, got {sorted(shapes)}")
    if mask is not None and tuple(mask.shape) != next(iter(shapes)):
        raise ValueError(f"mask shape {tuple(mask.shape)} != ratio shape {next(iter(shapes))}")
    valid = torch.ones_like(ratio_fp8, dtype=torch.bool) if mask is None else mask.bool()
    f64 = lambda x: x.detach().to(torch.float64)[valid]  # noqa: E731
    n = int(valid.sum())
    if n == 0:
        nan = float("nan")
        return {"calib/ratio_error_amplification": nan, "calib/ratio_abs_err": nan, "calib/prob_abs_err": nan}
    r_err = float((f64(ratio_fp8) - f64(ratio_bf16)).abs().mean())
    p_err = float((f64(prob_fp8) - f64(prob_bf16)).abs().mean())
    amp = r_err / p_err if p_err > 0 else float("nan")
    return {"calib/ratio_error_amplification": amp, "calib/ratio_abs_err": r_err, "calib/prob_abs_err": p_err}


def _pick(grid: torch.Tensor, objective: torch.Tensor, current: float) -> float:
    """argmin of objective over grid; ties -> closest to current, then smaller."""
    best = objective.min()
    cands = grid[objective <= best + 1e-15]
    dist = (cands - current).abs()
    cands = cands[dist <= dist.min() + 1e-12]
    return float(cands.min())


def _count_below(sorted_vals: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(sorted_vals, thresholds, side="left")  # #{v < thr}


def _mass_above(sorted_vals: torch.Tensor, weights_sorted: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """sum of weights whose value > thr (values sorted ascending)."""
    suffix = torch.cat([weights_sorted.flip(0).cumsum(0).flip(0), weights_sorted.new_zeros(1)])
    return suffix[torch.searchsorted(sorted_vals, thresholds, side="right")]


def _step_toward(current: float, target: float, cap: float, rng: tuple[float, float]) -> float:
    moved = current + max(-cap, min(cap, target - current))
    return round(min(max(moved, rng[0]), rng[1]), _ROUND)


class CalibratedClipping:
    """Stateful Calibrated Clipping controller (objectives in the module docstring)."""

    def __init__(self, config: CalibratedClippingConfig) -> None:
        self.config = config
        self.low = float(config.clip_init_low)
        self.high = float(config.clip_init_high)
        self.last_step: int | None = None
        self.num_calibrations = 0

    @property
    def bounds(self) -> tuple[float, float]:
        return self.low, self.high

    def should_calibrate(self, step: int) -> bool:
        """True on every ``clip_period``-th step (step > 0) not calibrated yet (so a resumed step is not redone)."""
        return step > 0 and step % self.config.clip_period == 0 and step != self.last_step

    def calibrate(
        self,
        step: int,
        ratio_fp8: torch.Tensor,
        ratio_bf16: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        prob_fp8: torch.Tensor | None = None,
        prob_bf16: torch.Tensor | None = None,
    ) -> tuple[tuple[float, float], dict[str, float]]:
        """Search, smooth and store new bounds from FP8 and BF16 ratios of the same tokens. Returns ``((L, H), diag)``;
        with ``prob_fp8`` / ``prob_bf16`` (the current policy's token probabilities, same layout as the ratios) the
        diagnostics include the ratio-error amplification (module docstring)."""
        if (prob_fp8 is None) != (prob_bf16 is None):
            raise ValueError("calibrate: give both prob_fp8 and prob_bf16, or neither")
        cfg = self.config
        rf, rb, adv = _flatten(ratio_fp8, ratio_bf16, advantages, mask)
        neg, pos = adv < 0, adv > 0
        # negative / positive advantage subsets, each once: ratios and silenced-mass weights |A| r
        rf_n, rb_n, a_n = rf[neg], rb[neg], -adv[neg]
        rf_p, rb_p, a_p = rf[pos], rb[pos], adv[pos]
        grid_l, grid_h = cfg.grid("low"), cfg.grid("high")
        old_low, old_high = self.low, self.high

        # ---- lower bound: match the fraction of negative-advantage tokens below the bound
        n_neg, n_pos = rf_n.numel(), rf_p.numel()
        rf_n_sorted = rf_n.sort().values
        frac_f = lambda thr: float(_count_below(rf_n_sorted, torch.tensor([thr], dtype=torch.float64))) / max(n_neg, 1)  # noqa: E731
        bf16_neg_frac = float((rb_n < cfg.ref_low).sum()) / max(n_neg, 1)
        if n_neg:
            obj_l = (_count_below(rf_n_sorted, grid_l).to(torch.float64) / n_neg - bf16_neg_frac).abs()
            target_low = _pick(grid_l, obj_l, old_low)
        else:
            target_low = old_low
        new_low = _step_toward(old_low, target_low, cfg.clip_max_delta_low, cfg.clip_low_range)

        # ---- upper bound: match BF16's positive share of silenced update mass (cross-multiplied)
        wb_n, wb_p, wf_n, wf_p = a_n * rb_n, a_p * rb_p, a_n * rf_n, a_p * rf_p
        m_neg_b = float(wb_n[rb_n < cfg.ref_low].sum())
        m_pos_b = float(wb_p[rb_p > cfg.ref_high].sum())
        m_neg_f = float(wf_n[rf_n < new_low].sum())
        scale = float(wf_n.sum() + wf_p.sum()) * float(wb_n.sum() + wb_p.sum())
        rf_p_sorted, order = rf_p.sort()
        m_pos_f_grid = _mass_above(rf_p_sorted, wf_p[order], grid_h)
        if n_pos:
            obj_h = (m_pos_f_grid * m_neg_b - m_pos_b * m_neg_f).abs() / max(scale, 1e-300)
            target_high = _pick(grid_h, obj_h, old_high)
        else:
            target_high = old_high
        new_high = _step_toward(old_high, target_high, cfg.clip_max_delta_high, cfg.clip_high_range)

        m_pos_f_new = float(wf_p[rf_p > new_high].sum())
        share = lambda p, n: p / (p + n) if p + n > 0 else 0.0  # noqa: E731
        self.low, self.high = new_low, new_high
        self.last_step = int(step)
        self.num_calibrations += 1
        diag = {
            "calib/bound_low": new_low,
            "calib/bound_high": new_high,
            "calib/target_low": target_low,
            "calib/target_high": target_high,
            "calib/bf16_lower_neg_frac": bf16_neg_frac,
            "calib/fp8_lower_neg_frac_at_ref": frac_f(cfg.ref_low),
            "calib/fp8_lower_neg_frac_before": frac_f(old_low),
            "calib/fp8_lower_neg_frac_after": frac_f(new_low),
            "calib/bf16_pos_mass_share": share(m_pos_b, m_neg_b),
            "calib/fp8_pos_mass_share_after": share(m_pos_f_new, m_neg_f),
            "calib/num_tokens": float(rf.numel()),
            "calib/step": float(step),
        }
        if prob_fp8 is not None:
            diag.update(ratio_error_amplification(ratio_fp8, ratio_bf16, prob_fp8, prob_bf16, mask))
        return (new_low, new_high), diag

    def state_dict(self) -> dict:
        """``low``, ``high``, ``last_step``, ``num_calibrations`` (what ``load_state_dict`` reads back) and ``config``
        (the settings, a record only: never read back)."""
        return {
            "low": self.low,
            "high": self.high,
            "last_step": self.last_step,
            "num_calibrations": self.num_calibrations,
            "config": dataclasses.asdict(self.config),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore bounds and step bookkeeping (the config stays the one this object was built with)."""
        for key in ("low", "high", "last_step", "num_calibrations"):
            if key not in state:
                raise ValueError(f"CalibratedClipping state is missing key {key!r}")
        low, high = float(state["low"]), float(state["high"])
        lo_rng, hi_rng = self.config.clip_low_range, self.config.clip_high_range
        if not lo_rng[0] <= low <= lo_rng[1]:
            raise ValueError(f"CalibratedClipping state 'low'={low} outside clip_low_range {lo_rng}")
        if not hi_rng[0] <= high <= hi_rng[1]:
            raise ValueError(f"CalibratedClipping state 'high'={high} outside clip_high_range {hi_rng}")
        self.low, self.high = low, high
        self.last_step = None if state["last_step"] is None else int(state["last_step"])
        self.num_calibrations = int(state["num_calibrations"])
