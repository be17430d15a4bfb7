"""Tasks of the nightly FP8-vs-BF16 regression: the MLflow parent run, linking the two training runs to it as child
runs, the comparison plot and the verdict.

The verdict compares the end-to-end FP8 runs with the BF16 runs of the same seeds and steps:

- accuracy:   the *paired* drop ``BF16 - FP8`` of validation accuracy ``<= max_accuracy_drop``: per seed, each
  validation prompt's correctness averaged over the validations after step 0 (steps val_period, 2 val_period, ...,
  the last), FP8 minus BF16 on the same prompt id, averaged over prompts and seeds (``paired_drop``; 95% CI from
  fp8core.stats.paired_bootstrap, prompts resampled within seed strata). The threshold comes from the power
  calculation below unless the caller sets one. (Without per-prompt files, e.g. older summaries: the final
  ``val/accuracy`` difference.)
- mismatch:   mean ``mismatch/token_mult_prob_error`` of the FP8 run ``<= max_token_mult_prob_error``
  (mean_t exp(|logp_train - logp_rollout|), NeMo RL's multiplicative probability error; 1.0 = no mismatch);
- throughput: ``(samples/s of FP8) / (samples/s of BF16) >= min_throughput_ratio``, samples/s of a whole RL step
  (both runs have the same prompts x generations per step, so this is the ratio of mean step times). The ratio
  depends on the CPU kind (fp8core.cpu): FP8 is emulated on CPU (quantize -> dequantize -> FP32 GEMM) while BF16
  runs on BF16 units only where the CPU has them (AVX512_BF16 / AMX); without them BF16 autocast is the slow path.
  So the floor is per kind (``MIN_THROUGHPUT_RATIO``, overridable), and the verdict states the kind it used.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from fp8core.stats import drop_test_plan, paired_bootstrap, seeds_needed
from tasks.tracking import client, experiment_id

TASK = dict(cache_policy=NO_CACHE, log_prints=False)
PLOT_KEYS = ("val/accuracy", "reward/mean", "mismatch/token_mult_prob_error", "throughput/samples_per_s",
             "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s")


# FP8/BF16 samples-per-second floor per CPU kind (fp8core.cpu.KINDS; "gpu" when the trainer runs on a GPU). One
# value for every kind until each kind has a measured nightly history to set it from (README "CPU kinds").
MIN_THROUGHPUT_RATIO: dict[str, float] = {"other": 0.2, "avx2": 0.2, "avx512": 0.2, "avx512_bf16": 0.2, "amx": 0.2,
                                          "gpu": 0.2}


# -- the power calculation of the accuracy check ----------------------------------------------------------------------
# What must hold: a real 5-point drop of FP8 against BF16 fails the verdict with >= 80% probability, and a correct
# FP8 run (no real drop) fails it at most 5% of the time. The verdict's statistic D (mean paired drop over S seeds)
# has standard error SE = NOISE_SD_PER_SEED / sqrt(S), where NOISE_SD_PER_SEED is the standard deviation of one seed's
# paired drop between two *correct* runs (FP8 and BF16 end to end, same warm start, same prompts and sampling seeds).
# The test fails when D > t. Power at a real drop d: 1 - Phi((t - d) / SE); false-fail rate: 1 - Phi(t / SE).
# With t = d - z(0.80) SE the power is exactly 80%; the false-fail rate is 1 - Phi(d / SE - 0.8416) <= 5% iff
# d / SE >= 0.8416 + 1.6449 = 2.487, i.e. S >= (2.487 NOISE_SD_PER_SEED / d)^2 (fp8core.stats.seeds_needed).
#
# NOISE_SD_PER_SEED, measured (README "The nightly regression"): per seed, D_s = mean over the 500 validation
# prompts of (BF16 - FP8) correctness averaged over the validations at steps 5, 10, 15 of the tiny recipes (probe
# warm start, `tools.compare_val diff --mean-over-steps` computes it from the runs' per-prompt files). Seeds 0 and 2,
# run with this code on 2026-12-01: D = -0.0007 and -0.0127; seed 1 from the README's earlier run of the same
# recipes (no per-prompt files, its curves give +0.0613). Sample SD over the three: 0.040. Cross-check: the
# prompt-bootstrap SE of one D_s is 0.010-0.014, so most of the noise is run to run (different RL trajectories),
# not prompt sampling. Using the final accuracy alone instead of the curve average, the same seeds give SD 0.096
# (about 6x the seeds for the same power). Three seeds pin the SD down only loosely (95% CI about 0.02-0.25):
# re-estimate it from the nightly's own per-seed drops (``seed_sd`` in verdict.json) as they accumulate.
DETECT_DROP = 0.05
DETECT_POWER = 0.80
MAX_FALSE_FAIL = 0.05
NOISE_SD_PER_SEED = 0.040
DEFAULT_SEEDS = seeds_needed(sd_per_seed=NOISE_SD_PER_SEED, effect=DETECT_DROP, power=DETECT_POWER,
                             false_fail=MAX_FALSE_FAIL)


def accuracy_plan(num_seeds: int, *, noise_sd: float = NOISE_SD_PER_SEED) -> dict:
    """The accuracy threshold for ``num_seeds`` paired seeds (80% power at a 5-point drop) and its false-fail rate."""
    plan = drop_test_plan(se=noise_sd / math.sqrt(num_seeds), effect=DETECT_DROP, power=DETECT_POWER)
    return {**plan.as_dict(), "seeds": num_seeds, "noise_sd_per_seed": noise_sd}


def _val_steps(summary: Mapping, set_name: str) -> dict[int, str]:
    files = (summary.get("val_files") or {}).get(set_name) or {}
    return {int(k): v for k, v in files.items()}


def _per_prompt(files: Mapping[int, str], steps: list[int]) -> dict:
    """prompt id -> correctness averaged over ``steps`` (ids present at every step)."""
    acc: dict = {}
    for st in steps:
        for line in Path(files[st]).read_text().splitlines():
            r = json.loads(line)
            acc.setdefault(r["id"], []).append(1.0 if r["correct"] else 0.0)
    return {k: sum(v) / len(v) for k, v in acc.items() if len(v) == len(steps)}


def paired_drop(bf16_runs: list[Mapping], fp8_runs: list[Mapping], *, set_name: str = "main", n_boot: int = 4000,
                seed: int = 0) -> dict | None:
    """The verdict's accuracy statistic from the runs' per-prompt validation files (``summary["val_files"]``), one
    BF16 and one FP8 run per seed (same order): per seed, per prompt id, correctness averaged over the validation
    steps after 0 that both runs have; drop = mean over prompts and seeds of BF16 - FP8, with a paired bootstrap 95%
    CI (seeds as strata). None when a run has no per-prompt files."""
    if len(bf16_runs) != len(fp8_runs) or not bf16_runs:
        raise ValueError(f"paired_drop: {len(bf16_runs)} BF16 runs vs {len(fp8_runs)} FP8 runs (one pair per seed)")
    a_rows, b_rows, per_seed, steps_used, ids = [], [], [], [], None
    for b, f in zip(bf16_runs, fp8_runs, strict=True):
        fb, ff = _val_steps(b, set_name), _val_steps(f, set_name)
        steps = sorted(set(fb) & set(ff) - {0}) or sorted(set(fb) & set(ff))
        if not steps:
            return None
        pb, pf = _per_prompt(fb, steps), _per_prompt(ff, steps)
        common = sorted(set(pb) & set(pf), key=str)
        ids = common if ids is None else [i for i in ids if i in set(common)]
        a_rows.append(pb)
        b_rows.append(pf)
        steps_used.append(steps)
    if not ids:
        return None
    a = [[r[i] for i in ids] for r in a_rows]
    b = [[r[i] for i in ids] for r in b_rows]
    diff = paired_bootstrap(b, a, n_boot=n_boot, seed=seed)  # mean of (BF16 - FP8): the drop
    per_seed = [sum(x - y for x, y in zip(ra, rb, strict=True)) / len(ids) for ra, rb in zip(a, b, strict=True)]
    one_seed_se = [(e.hi - e.lo) / (2 * 1.959964) for e in
                   (paired_bootstrap(rb, ra, n_boot=n_boot, seed=seed) for ra, rb in zip(a, b, strict=True))]
    return {"drop": diff.value, "drop_ci_lo": diff.lo, "drop_ci_hi": diff.hi, "per_seed_drop": per_seed,
            "seed_sd": diff.seed_sd, "prompt_se_per_seed": one_seed_se, "prompts": len(ids), "seeds": len(a),
            "steps": steps_used[0], "acc_bf16": sum(map(sum, a)) / (len(a) * len(ids)),
            "acc_fp8": sum(map(sum, b)) / (len(b) * len(ids))}


def throughput_threshold(cpu_kind: str, override: float | Mapping[str, float] | None = None) -> float:
    """The throughput floor for ``cpu_kind``: ``override`` when it is a number, else its entry for the kind, else
    ``MIN_THROUGHPUT_RATIO``'s (kinds it does not know fall back to the lowest floor there)."""
    if isinstance(override, (int, float)) and not isinstance(override, bool):
        return float(override)
    table = {**MIN_THROUGHPUT_RATIO, **dict(override or {})}
    return float(table.get(cpu_kind, min(table.values())))


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x)) else None


def verdict(bf16: dict, fp8: dict, *, max_accuracy_drop: float, max_token_mult_prob_error: float,
            min_throughput_ratio: float, cpu_kind: str = "unknown", paired: dict | None = None,
            plan: dict | None = None) -> dict:
    """Checks of the FP8 run summary against the BF16 one (keys as returned by the ``fp8-grpo`` flow:
    ``val_accuracy_end``, ``mean_token_mult_prob_error``, ``mean_step_s``). A missing or non-finite value fails its
    check. ``cpu_kind`` is the kind the runs trained on (the throughput floor is per kind). With ``paired``
    (``paired_drop``'s result) the accuracy check uses the paired drop over prompts, seeds and validation steps;
    ``plan`` (``accuracy_plan``) is reported beside it. Returns ``{"passed": bool, "cpu_kind": str, "checks":
    [{name, value, threshold, passed, rule}], "info": {...}, "paired": ..., "plan": ...}``."""
    checks = []

    def add(name: str, value: float | None, threshold: float, ok, rule: str):
        checks.append({"name": name, "value": value, "threshold": threshold, "rule": rule,
                       "passed": value is not None and bool(ok(value))})

    acc_b, acc_f = _num(bf16.get("val_accuracy_end")), _num(fp8.get("val_accuracy_end"))
    if paired is not None:
        add("accuracy_drop", _num(paired["drop"]), max_accuracy_drop, lambda v: v <= max_accuracy_drop,
            f"paired drop BF16 - FP8 (per-prompt accuracy over {paired['prompts']} prompts x {paired['seeds']} "
            f"seeds x validations at steps {paired['steps']}) <= max_accuracy_drop")
    else:
        drop = acc_b - acc_f if acc_b is not None and acc_f is not None else None
        add("accuracy_drop", drop, max_accuracy_drop, lambda v: v <= max_accuracy_drop,
            "val_accuracy(bf16) - val_accuracy(fp8) <= max_accuracy_drop")
    mm = _num(fp8.get("mean_token_mult_prob_error"))
    add("token_mult_prob_error", mm, max_token_mult_prob_error, lambda v: v <= max_token_mult_prob_error,
        "mean mismatch/token_mult_prob_error(fp8) <= max_token_mult_prob_error")
    s_b, s_f = _num(bf16.get("mean_step_s")), _num(fp8.get("mean_step_s"))
    ratio = s_b / s_f if s_b is not None and s_f else None
    add("throughput_ratio", ratio, min_throughput_ratio, lambda v: v >= min_throughput_ratio,
        f"samples_per_s(fp8) / samples_per_s(bf16) >= min_throughput_ratio (CPU kind {cpu_kind})")

    def r(key):
        a, b = _num(fp8.get(key)), _num(bf16.get(key))
        return a / b if a is not None and b else None

    info = {"val_accuracy_bf16": acc_b, "val_accuracy_fp8": acc_f,
            "token_mult_prob_error_bf16": _num(bf16.get("mean_token_mult_prob_error")),
            "mean_step_s_bf16": s_b, "mean_step_s_fp8": s_f,
            "rollout_tokens_per_s_ratio": r("mean_rollout_tokens_per_s"),
            "train_tokens_per_s_ratio": r("mean_train_tokens_per_s")}
    if paired is not None:
        info.update(drop_ci_lo=paired["drop_ci_lo"], drop_ci_hi=paired["drop_ci_hi"], seed_sd=paired["seed_sd"],
                    paired_acc_bf16=paired["acc_bf16"], paired_acc_fp8=paired["acc_fp8"])
    if plan is not None:
        info.update(power_at_5_points=plan["power"], false_fail_rate=plan["false_fail"],
                    noise_sd_per_seed=plan["noise_sd_per_seed"])
    return {"passed": all(c["passed"] for c in checks), "cpu_kind": cpu_kind, "checks": checks, "info": info,
            "paired": paired, "plan": plan}


def verdict_markdown(v: dict, *, parent_run_id: str, children: dict[str, str]) -> str:
    lines = [f"# FP8 vs BF16 regression: {'PASS' if v['passed'] else 'FAIL'}", "",
             f"MLflow parent run `{parent_run_id}`; children: " + ", ".join(f"{k} `{r}`" for k, r in children.items()),
             "", f"CPU kind: {v.get('cpu_kind', 'unknown')} (the throughput floor depends on it)",
             "", "| check | value | threshold | rule | result |", "|---|---|---|---|---|"]
    for c in v["checks"]:
        val = "missing" if c["value"] is None else f"{c['value']:.4f}"
        lines.append(f"| {c['name']} | {val} | {c['threshold']} | {c['rule']} | {'pass' if c['passed'] else 'FAIL'} |")
    lines += ["", "| info | value |", "|---|---|"]
    lines += [f"| {k} | {'-' if x is None else f'{x:.4f}'} |" for k, x in v["info"].items()]
    p, plan = v.get("paired"), v.get("plan")
    if p:
        lines += ["", f"Paired drop BF16 - FP8: {p['drop']:+.4f} (95% CI [{p['drop_ci_lo']:+.4f}, {p['drop_ci_hi']:+.4f}]; "
                  f"{p['prompts']} prompts x {p['seeds']} seeds, validations at steps {p['steps']}); per seed: "
                  + ", ".join(f"{d:+.4f}" for d in p["per_seed_drop"])]
    if plan:
        lines += ["", f"Power: threshold {plan['threshold']:.4f} with {plan['seeds']} seeds (SE {plan['se']:.4f} = "
                  f"noise SD per seed {plan['noise_sd_per_seed']} / sqrt(seeds)): a real {plan['effect']:.2f} drop "
                  f"fails with probability {plan['power']:.0%}, a correct FP8 run fails {plan['false_fail']:.1%} of "
                  "the time (tasks/regression.py)."]
    return "\n".join(lines)


@task(name="mlflow-parent-run", **TASK, retries=2, retry_delay_seconds=1)
def create_parent_run(uri: str, experiment_name: str, run_name: str, params: dict, tags: dict) -> str:
    from mlflow.entities import Param, RunTag

    c = client(uri)
    run = c.create_run(experiment_id(c, experiment_name), run_name=run_name, tags=tags)
    c.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())],
                tags=[RunTag("mlflow.note.content", "Nightly FP8-vs-BF16 regression (parent of the two training runs)")])
    return run.info.run_id


@task(name="mlflow-link-child", **TASK, retries=2, retry_delay_seconds=1)
def link_child(uri: str, parent_run_id: str, experiment_name: str, run_name: str, role: str,
               seed: int | None = None) -> str | None:
    """Make the training run named ``run_name`` a child of the parent (MLflow's ``mlflow.parentRunId`` tag, which
    the UI nests by). Found by name, so a training run that failed half-way is linked too. Returns its run id."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment_name)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'", max_results=5)
    if not runs:
        return None
    run_id = runs[0].info.run_id
    c.set_tag(run_id, "mlflow.parentRunId", parent_run_id)
    c.set_tag(run_id, "regression.role", role)
    if seed is not None:
        c.set_tag(run_id, "regression.seed", str(seed))
    return run_id


@task(name="comparison-plot", **TASK)
def comparison_plot(uri: str, parent_run_id: str, children: dict[str, str], out_dir: str) -> str:
    """Validation accuracy, reward, token-mult-prob-error and throughput against step, one line per child run;
    logged to the parent run as ``comparison.png`` (and written under ``out_dir``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = client(uri)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, key in zip(axes.flat, PLOT_KEYS, strict=True):
        for role, run_id in children.items():
            hist = sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)
            ax.plot([m.step for m in hist], [m.value for m in hist], marker="o", ms=3, label=role)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle("FP8 (end-to-end) vs BF16, same seed and steps")
    fig.tight_layout()
    path = Path(out_dir) / "comparison.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    c.log_figure(parent_run_id, fig, "comparison.png")
    plt.close(fig)
    return str(path)


@task(name="log-verdict", **TASK, retries=2, retry_delay_seconds=1)
def log_verdict(uri: str, parent_run_id: str, v: dict, markdown: str, step: int) -> None:
    """verdict.json + verdict.md artifacts, ``regression/*`` metrics and a ``verdict`` tag on the parent run, and a
    Prefect markdown artifact (key ``fp8-vs-bf16-verdict``) on the flow run."""
    from mlflow.entities import Metric
    from prefect.artifacts import create_markdown_artifact

    c = client(uri)
    c.log_text(parent_run_id, json.dumps(v, indent=1), "verdict.json")
    c.log_text(parent_run_id, markdown, "verdict.md")
    now = int(time.time() * 1000)
    metrics = [Metric(f"regression/{ch['name']}", ch["value"], now, step) for ch in v["checks"]
               if ch["value"] is not None]
    metrics += [Metric(f"regression/{k}", x, now, step) for k, x in v["info"].items()
                if x is not None and math.isfinite(x)]
    metrics.append(Metric("regression/passed", float(v["passed"]), now, step))
    c.log_batch(parent_run_id, metrics=metrics)
    c.set_tag(parent_run_id, "verdict", "pass" if v["passed"] else "fail")
    c.set_tag(parent_run_id, "cpu_kind", v.get("cpu_kind", "unknown"))
    create_markdown_artifact(markdown, key="fp8-vs-bf16-verdict", description="FP8 vs BF16 regression verdict")
