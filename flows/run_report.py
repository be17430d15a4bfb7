"""What a training run says: the terminal's line per step and its validation and closing lines, the summary
(``summary.json``, the flow's return value) and the run's answer in Markdown (the Prefect artifact and the MLflow
run's report). Pure functions of the recipe and the run's metrics: the flow (flows/grpo.py) calls them."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs.schema import Config


def progress_line(step: int, total: int, m: dict, val: float | None) -> str:
    acc = f"{val:.3f}" if val is not None else "  -  "
    return (f"step {step:>3}/{total} | reward {m.get('reward/mean', float('nan')):.3f} | val_acc {acc} | "
            f"mismatch {m.get('mismatch/token_mult_prob_error', float('nan')):.4f} | "
            f"clip [{_bound(m, 'clip/bound_low')},{_bound(m, 'clip/bound_high')}] | "
            f"step {m.get('time/step_s', 0):5.1f}s (rollout {m.get('time/rollout_s', 0):.1f} "
            f"train {m.get('time/train_s', 0):.1f} calib {m.get('time/calibrate_s', 0):.1f})")


def run_report(cfg: Config, s: dict, val_metrics: dict[int, dict]) -> str:
    """The run's answer in markdown (the Prefect artifact): recipe, CPU kind, steps, validation accuracy start -> end
    with 95% CIs, the mean mismatch, the step-time split and where the MLflow run is."""
    def acc(step):
        m = val_metrics.get(step, {})
        if "val/accuracy" not in m:
            return "-"
        return f"{m['val/accuracy']:.3f} [{m['val/accuracy_lo']:.3f}, {m['val/accuracy_hi']:.3f}]"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    steps = sorted(val_metrics)
    split = ", ".join(f"{k} {v:.2f}" for k, v in (s.get("mean_time_split_s") or {}).items() if v is not None)
    mode = (f"asynchronous (max trajectory age {cfg.grpo.async_grpo.max_trajectory_age_steps})"
            if cfg.grpo.async_grpo.enabled else "synchronous")
    rows = [("recipe", f"`{cfg.recipe}` ({s['precision']}), {mode}"),
            ("CPU kind", f"{s.get('cpu_kind', '-')} (rollout {s.get('cpu_rollout_kind', '-')})"),
            ("steps", f"{s['first_step']}-{s['last_step']} ({s['steps_run']} run) of {cfg.grpo.max_num_steps}"),
            ("validation accuracy (greedy, 95% CI)",
             f"{acc(steps[0])} (step {steps[0]}) -> {acc(steps[-1])} (step {steps[-1]})" if steps else "-"),
            ("mean token-mult-prob-error", num(s.get("mean_token_mult_prob_error"), ".4f")),
            ("mean step / step interval (s)", f"{num(s.get('mean_step_s'), '.2f')} / "
                                              f"{num(s.get('step_interval_s'), '.2f')}"),
            ("mean step split (s)", split or "-"),
            ("MLflow", s.get("mlflow_ui_url") or s.get("mlflow_run_id") or "off"),
            ("checkpoint", s.get("checkpoint") or "-")]
    return "\n".join([f"# fp8-grpo run: {cfg.recipe}", "", "| | |", "|---|---|",
                      *(f"| {k} | {v} |" for k, v in rows)])


def summarize(cfg, history, val_acc, start_step, last_ck, uri, run_id, wall) -> dict:
    def mean(key):
        vals = [m[key] for m in history if key in m]
        return sum(vals) / len(vals) if vals else None

    steps = sorted(val_acc)
    split = {k[len("time/"):-2]: mean(k) for k in ("time/refit_s", "time/rollout_s", "time/reward_s",
                                                    "time/train_s", "time/calibrate_s", "time/clip_calibration_s")}
    return {"recipe": cfg.recipe, "precision": cfg.precision_tag, "steps_run": len(history),
            "first_step": start_step + 1, "last_step": start_step + len(history),
            "val_accuracy_start": val_acc[steps[0]] if steps else None,
            "val_accuracy_end": val_acc[steps[-1]] if steps else None, "val_accuracy": val_acc,
            "reward_mean": mean("reward/mean"),
            "mean_token_mult_prob_error": mean("mismatch/token_mult_prob_error"),
            "mean_step_s": mean("time/step_s"), "step_interval_s": step_interval(history),
            "mean_time_split_s": split,
            "mean_rollout_tokens_per_s": mean("throughput/rollout_tokens_per_s"),
            "mean_train_tokens_per_s": mean("throughput/train_tokens_per_s"),
            "checkpoint": last_ck, "mlflow_tracking_uri": uri, "mlflow_run_id": run_id, "wall_s": wall}


def step_interval(history: list[dict]) -> float | None:
    """Mean wall time between consecutive step completions over the run's steps 2..N (the same definition
    synchronous and asynchronous; validation between steps counts): None with fewer than two steps."""
    ends = [m["time/step_end_unix"] for m in history if "time/step_end_unix" in m]
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None


def val_lines(step: int, cfg: Config, m: dict, names: list[str]) -> str:
    """The terminal's validation lines at the first and the last validation: each set's greedy accuracy with its
    95% CI, and pass@k / avg@k (with CIs) where sampled."""
    parts = []
    for name in names:
        p = f"val/{name}/"
        parts.append(f"{name} {m[p + 'accuracy']:.3f} [{m[p + 'accuracy_lo']:.3f}, {m[p + 'accuracy_hi']:.3f}] "
                     f"({int(m[p + 'num_prompts'])} prompts)")
    lines = [f"step {step:>3}/{cfg.grpo.max_num_steps} | validation accuracy (greedy, 95% CI): " + " | ".join(parts)
             + f" | {m['time/validate_s']:.1f}s"]
    ev = cfg.evaluation
    for name in names:
        p = f"val/{name}/"
        if p + "sampled_prompts" not in m:
            continue
        # avg@k = c/n for every k (the mean accuracy of one sample): printed once, for the largest k
        pairs = [("pass", k) for k in ev.pass_k] + [("avg", max(ev.pass_k))]
        est = [f"{kind}@{k} {m[f'{p}{kind}_at_{k}']:.3f} [{m[f'{p}{kind}_at_{k}_lo']:.3f}, "
               f"{m[f'{p}{kind}_at_{k}_hi']:.3f}]" for kind, k in pairs]
        lines.append(f"           {name}, {ev.num_samples} samples at T={cfg.policy.generation.temperature} on "
                     f"{int(m[p + 'sampled_prompts'])} prompts: " + ", ".join(est))
    return "\n".join(lines)


def final_lines(s: dict) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [f"done: {s['steps_run']} steps of {s['recipe']} ({s['precision']}) in {s['wall_s']:.0f}s; "
             f"val accuracy {f(s['val_accuracy_start'], '.3f')} -> {f(s['val_accuracy_end'], '.3f')}; "
             f"mean token-mult-prob-error {f(s['mean_token_mult_prob_error'], '.4f')}; "
             f"mean step {f(s['mean_step_s'], '.1f')}s; validation {f(s.get('validate_share'), '.0%')} of the wall time"]
    if s.get("mlflow_run_id"):
        lines.append(f"MLflow run {s['mlflow_run_id']} (experiment {s.get('mlflow_experiment_id')}, "
                     f"{s['mlflow_tracking_uri']})")
        if s.get("mlflow_ui_url"):
            lines.append(f"MLflow charts: {s['mlflow_ui_url']}"
                         + (f"  (start the UI: {s['mlflow_ui_command']})" if s.get("mlflow_ui_command") else ""))
    if s.get("checkpoint"):
        lines.append(f"checkpoint: {s['checkpoint']}")
    return "\n".join(lines)


def _bound(m: dict, key: str) -> str:
    """A clip bound of the step as the progress line shows it; ``-`` for a step that trained nothing (every group
    filtered by dynamic sampling: no loss, no bound used)."""
    return f"{m[key]:.2f}" if key in m else " -  "
