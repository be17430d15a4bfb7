"""Evaluation statistics (pure numpy + the standard library): pass@k / avg@k, confidence intervals for an accuracy,
and a paired, seed-stratified bootstrap of a difference over prompts.

Estimators
----------
- **pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with ``n >= k`` samples
  of which ``c`` are correct, the unbiased estimate of "at least one of k samples is correct" is
  ``1 - C(n - c, k) / C(n, k)``, computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no huge binomials;
  exactly 1 when ``n - c < k``). The plain ``1 - (1 - c/n) ** k`` is biased low and is not used.
- **avg@k**: the expected share of correct answers among k samples, estimated without bias by ``c / n`` for any
  ``n >= k`` (so avg@k of a prompt does not depend on k; k only states how many samples the figure promises).
- The figure of a set is the mean of the per-prompt estimates. Its CI: **Wilson** score interval for a plain accuracy
  (0/1 per prompt); percentile **bootstrap over prompts** for pass@k / avg@k (per-prompt values in [0, 1]).

Paired differences
------------------
``paired_bootstrap`` takes per-prompt values of two arms on the *same prompts* (``b - a``: end - start of one run,
or FP8 - BF16 on the same prompts and seeds), one row per seed (a stratum). The statistic is the mean over seeds of
the mean over prompts of ``b - a``. Each bootstrap replicate resamples prompts with replacement *within each seed
stratum*; by default (``shared_prompts=True``, all strata over the same prompt list) the *same* resampled prompt
indices are used in every stratum, which keeps a prompt's correlation across seeds (a prompt that one arm gets
systematically wrong counts once per replicate, not independently per seed) and so does not understate the
interval; ``shared_prompts=False`` resamples each stratum independently (strata over different prompts). Seeds are
not resampled (three seeds are too few to bootstrap): the seed-to-seed spread of the per-seed means is reported
beside the interval (``seed_sd``), so a reader can see when it, not prompt noise, dominates.

Every function takes arrays and keyword-only scalars and returns floats / a small frozen dataclass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

__all__ = [
    "Estimate",
    "pass_at_k",
    "pass_at_k_per_prompt",
    "avg_at_k_per_prompt",
    "wilson_interval",
    "accuracy_estimate",
    "bootstrap_mean",
    "sample_estimates",
    "paired_bootstrap",
    "z_quantile",
    "DropTestPlan",
    "drop_test_plan",
    "seeds_needed",
]


def z_quantile(p: float) -> float:
    """The standard normal quantile (``z_quantile(0.975) = 1.95996...``)."""
    return NormalDist().inv_cdf(p)


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its two-sided confidence interval ``[lo, hi]`` at ``confidence``; ``n`` is the number of
    units it averages (prompts, or prompts x seeds for a stratified difference). ``seed_sd``: standard deviation of
    the per-seed means (``nan`` with one seed or when not applicable)."""

    value: float
    lo: float
    hi: float
    n: int
    confidence: float = 0.95
    seed_sd: float = float("nan")

    def as_dict(self) -> dict:
        return asdict(self)

    def fmt(self, digits: int = 3) -> str:
        return f"{self.value:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


# -- pass@k / avg@k ----------------------------------------------------------------------------------------------------


def _check_nck(n: int, c: int, k: int) -> None:
    if not (isinstance(k, (int, np.integer)) and k >= 1):
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if n < k:
        raise ValueError(f"pass@k needs n >= k samples per prompt (n={n}, k={k})")
    if not 0 <= c <= n:
        raise ValueError(f"number correct c={c} outside [0, n={n}]")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021), as a stable product."""
    _check_nck(int(n), int(c), k)
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_per_prompt(correct: np.ndarray, k: int) -> np.ndarray:
    """Per-prompt unbiased pass@k from a ``(prompts, n)`` 0/1 matrix of per-sample correctness."""
    m = _as_matrix(correct)
    n = m.shape[1]
    return np.array([pass_at_k(n, int(c), k) for c in m.sum(axis=1)], dtype=np.float64)


def avg_at_k_per_prompt(correct: np.ndarray, k: int) -> np.ndarray:
    """Per-prompt unbiased avg@k (= c / n for any n >= k) from a ``(prompts, n)`` 0/1 matrix."""
    m = _as_matrix(correct)
    _check_nck(m.shape[1], 0, k)
    return m.mean(axis=1, dtype=np.float64)


def _as_matrix(correct) -> np.ndarray:
    m = np.asarray(correct)
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"per-sample correctness must be a non-empty (prompts, samples) matrix, got shape {m.shape}")
    if not np.isin(m, (0, 1)).all():
        raise ValueError("per-sample correctness must be 0/1 (or bool)")
    return m.astype(np.float64)


# -- intervals ---------------------------------------------------------------------------------------------------------


def wilson_interval(successes: int, total: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (good at small n and near 0 / 1, unlike the normal one)."""
    if total <= 0:
        raise ValueError(f"total must be > 0, got {total}")
    if not 0 <= successes <= total:
        raise ValueError(f"successes={successes} outside [0, total={total}]")
    z = z_quantile(0.5 + confidence / 2)
    p = successes / total
    den = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / den
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / den
    lo = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends: the float sum leaves ~1e-17
    hi = 1.0 if successes == total else min(1.0, centre + half)
    return lo, hi


def accuracy_estimate(correct: Sequence[bool] | np.ndarray, *, confidence: float = 0.95) -> Estimate:
    """Accuracy of 0/1 per-prompt results with its Wilson interval."""
    x = np.asarray(correct, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("accuracy of an empty set")
    s = int(x.sum())
    lo, hi = wilson_interval(s, x.size, confidence=confidence)
    return Estimate(s / x.size, lo, hi, int(x.size), confidence)


def _percentile_ci(reps: np.ndarray, confidence: float) -> tuple[float, float]:
    a = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [a, 1 - a])
    return float(lo), float(hi)


def bootstrap_mean(values: Sequence[float] | np.ndarray, *, n_boot: int = 10_000, seed: int = 0,
                   confidence: float = 0.95) -> Estimate:
    """Mean of per-prompt values with a percentile bootstrap interval (prompts resampled with replacement)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("bootstrap of an empty set")
    rng = np.random.default_rng(seed)
    reps = np.empty(n_boot)
    for s in range(0, n_boot, 1000):  # chunks: (1000, n) index blocks
        m = min(1000, n_boot - s)
        reps[s:s + m] = x[rng.integers(0, x.size, size=(m, x.size))].mean(axis=1)
    lo, hi = _percentile_ci(reps, confidence)
    return Estimate(float(x.mean()), lo, hi, int(x.size), confidence)


def sample_estimates(correct: np.ndarray, ks: Sequence[int], *, n_boot: int = 2000, seed: int = 0,
                     confidence: float = 0.95) -> dict[str, Estimate]:
    """``{"pass@k": ..., "avg@k": ...}`` for each k of a ``(prompts, n)`` per-sample correctness matrix, each the mean
    of the unbiased per-prompt estimates with a bootstrap interval over prompts."""
    out: dict[str, Estimate] = {}
    for k in ks:
        out[f"pass@{k}"] = bootstrap_mean(pass_at_k_per_prompt(correct, k), n_boot=n_boot, seed=seed,
                                          confidence=confidence)
        out[f"avg@{k}"] = bootstrap_mean(avg_at_k_per_prompt(correct, k), n_boot=n_boot, seed=seed,
                                         confidence=confidence)
    return out


# -- paired difference, seeds as strata --------------------------------------------------------------------------------


def paired_bootstrap(a: Sequence | np.ndarray, b: Sequence | np.ndarray, *, n_boot: int = 10_000, seed: int = 0,
                     confidence: float = 0.95, shared_prompts: bool = True) -> Estimate:
    """Mean of ``b - a`` over prompts and seeds with a paired bootstrap CI, seeds as strata.

    ``a`` and ``b``: per-prompt values (0/1 correctness, pass@k estimates, ...) as one row per seed -- a 1-D array is
    one seed; a list of 1-D arrays allows seeds over different prompt lists (then ``shared_prompts`` must be False).
    ``a[s][p]`` and ``b[s][p]`` must be the same prompt. The value is ``mean_s mean_p (b - a)``; each replicate
    resamples prompts within each stratum (the same indices in every stratum when ``shared_prompts``), and the
    interval is the percentile interval of the replicates.
    """
    da, db = _strata(a, "a"), _strata(b, "b")
    if len(da) != len(db):
        raise ValueError(f"a has {len(da)} seed strata, b has {len(db)}")
    diffs = []
    for s, (x, y) in enumerate(zip(da, db, strict=True)):
        if x.shape != y.shape:
            raise ValueError(f"seed stratum {s}: a has {x.size} prompts, b has {y.size} (they must be paired)")
        diffs.append(y - x)
    sizes = {d.size for d in diffs}
    if shared_prompts and len(sizes) != 1:
        raise ValueError(f"shared_prompts=True needs the same prompts in every seed stratum, got sizes {sorted(sizes)}")
    per_seed = np.array([d.mean() for d in diffs])
    value = float(per_seed.mean())
    rng = np.random.default_rng(seed)
    reps = np.zeros(n_boot)
    for s0 in range(0, n_boot, 1000):
        m = min(1000, n_boot - s0)
        if shared_prompts:
            mat = np.stack(diffs)  # (seeds, prompts)
            idx = rng.integers(0, mat.shape[1], size=(m, mat.shape[1]))
            reps[s0:s0 + m] = mat[:, idx].mean(axis=2).mean(axis=0)
        else:
            acc = np.zeros(m)
            for d in diffs:
                acc += d[rng.integers(0, d.size, size=(m, d.size))].mean(axis=1)
            reps[s0:s0 + m] = acc / len(diffs)
    lo, hi = _percentile_ci(reps, confidence)
    seed_sd = float(per_seed.std(ddof=1)) if per_seed.size > 1 else float("nan")
    return Estimate(value, lo, hi, int(sum(d.size for d in diffs)), confidence, seed_sd)


def _strata(x, name: str) -> list[np.ndarray]:
    if isinstance(x, np.ndarray):
        rows = [x] if x.ndim == 1 else list(x)
    else:
        x = list(x)
        rows = [x] if x and np.ndim(x[0]) == 0 else x
    out = [np.asarray(r, dtype=np.float64).ravel() for r in rows]
    if not out or any(r.size == 0 for r in out):
        raise ValueError(f"{name}: needs at least one seed stratum with at least one prompt")
    if any(not np.isfinite(r).all() for r in out):
        raise ValueError(f"{name}: non-finite per-prompt values")
    return out


# -- power of a one-sided "drop" test ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DropTestPlan:
    """A one-sided test "the candidate is worse by more than ``threshold``" on a mean difference whose standard error
    is ``se`` (normal approximation): it fails a run when the observed drop exceeds ``threshold``.
    ``false_fail`` = P(fail | no real drop) = 1 - Phi(threshold / se); ``power`` = P(fail | a real drop of
    ``effect``) = 1 - Phi((threshold - effect) / se)."""

    se: float
    effect: float
    threshold: float
    power: float
    false_fail: float

    def as_dict(self) -> dict:
        return asdict(self)


def drop_test_plan(*, se: float, effect: float, power: float = 0.8) -> DropTestPlan:
    """The threshold that detects a real drop of ``effect`` with probability ``power`` given the standard error
    ``se`` of the measured drop: ``threshold = effect - z(power) * se``; returns it with its false-fail rate."""
    if not (se > 0 and effect > 0 and 0.5 <= power < 1):
        raise ValueError(f"need se > 0, effect > 0 and power in [0.5, 1), got se={se}, effect={effect}, power={power}")
    nd = NormalDist()
    t = effect - nd.inv_cdf(power) * se
    return DropTestPlan(se=se, effect=effect, threshold=t, power=power, false_fail=1 - nd.cdf(t / se))


def seeds_needed(*, sd_per_seed: float, effect: float, power: float = 0.8, false_fail: float = 0.05) -> int:
    """Paired seeds needed so that a drop of ``effect`` fails with ``power`` while no drop fails at most ``false_fail``
    of the time, when one seed's paired difference has standard deviation ``sd_per_seed``:
    ``S >= (sd * (z(power) + z(1 - false_fail)) / effect) ** 2``."""
    if not (sd_per_seed > 0 and effect > 0):
        raise ValueError(f"need sd_per_seed > 0 and effect > 0, got {sd_per_seed}, {effect}")
    z = z_quantile(power) + z_quantile(1 - false_fail)
    return max(1, math.ceil((sd_per_seed * z / effect) ** 2))
