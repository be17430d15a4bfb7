"""Tasks of the nightly FP8-vs-BF16 regression: the MLflow parent run, linking the two training runs to it as child
runs, the comparison plot and the verdict.

The verdict compares the end-to-end FP8 run with the BF16 run of the same seed and steps:

- accuracy:   ``acc_bf16 - acc_fp8 <= max_accuracy_drop`` on the final validation accuracy (``val/accuracy``);
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

from tasks.tracking import client

TASK = dict(cache_policy=NO_CACHE, log_prints=False)
PLOT_KEYS = ("val/accuracy", "reward/mean", "mismatch/token_mult_prob_error", "throughput/samples_per_s",
             "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s")


# FP8/BF16 samples-per-second floor per CPU kind (fp8core.cpu.KINDS; "gpu" when the trainer runs on a GPU). One
# value for every kind until each kind has a measured nightly history to set it from (README "CPU kinds").
MIN_THROUGHPUT_RATIO: dict[str, float] = {"other": 0.2, "avx2": 0.2, "avx512": 0.2, "avx512_bf16": 0.2, "amx": 0.2,
                                          "gpu": 0.2}


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
            min_throughput_ratio: float, cpu_kind: str = "unknown") -> dict:
    """Checks of the FP8 run summary against the BF16 one (keys as returned by the ``fp8-grpo`` flow:
    ``val_accuracy_end``, ``mean_token_mult_prob_error``, ``mean_step_s``). A missing or non-finite value fails its
    check. ``cpu_kind`` is the kind the runs trained on (the throughput floor is per kind). Returns
    ``{"passed": bool, "cpu_kind": str, "checks": [{name, value, threshold, passed, rule}], "info": {...}}``."""
    checks = []

    def add(name: str, value: float | None, threshold: float, ok, rule: str):
        checks.append({"name": name, "value": value, "threshold": threshold, "rule": rule,
                       "passed": value is not None and bool(ok(value))})

    acc_b, acc_f = _num(bf16.get("val_accuracy_end")), _num(fp8.get("val_accuracy_end"))
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
    return {"passed": all(c["passed"] for c in checks), "cpu_kind": cpu_kind, "checks": checks, "info": info}


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
    return "\n".join(lines)


@task(name="mlflow-parent-run", **TASK, retries=2, retry_delay_seconds=1)
def create_parent_run(uri: str, experiment_name: str, run_name: str, params: dict, tags: dict) -> str:
    from mlflow.entities import Param, RunTag

    c = client(uri)
    exp = c.get_experiment_by_name(experiment_name)
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment_name)
    run = c.create_run(exp_id, run_name=run_name, tags=tags)
    c.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())],
                tags=[RunTag("mlflow.note.content", "Nightly FP8-vs-BF16 regression (parent of the two training runs)")])
    return run.info.run_id


@task(name="mlflow-link-child", **TASK, retries=2, retry_delay_seconds=1)
def link_child(uri: str, parent_run_id: str, experiment_name: str, run_name: str, role: str) -> str | None:
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
    metrics += [Metric(f"regression/{k}", x, now, step) for k, x in v["info"].items() if x is not None]
    metrics.append(Metric("regression/passed", float(v["passed"]), now, step))
    c.log_batch(parent_run_id, metrics=metrics)
    c.set_tag(parent_run_id, "verdict", "pass" if v["passed"] else "fail")
    c.set_tag(parent_run_id, "cpu_kind", v.get("cpu_kind", "unknown"))
    create_markdown_artifact(markdown, key="fp8-vs-bf16-verdict", description="FP8 vs BF16 regression verdict")
