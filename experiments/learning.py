"""Experiment ``fp8-grpo-learning``: does RL learn on the embedded workload, in BF16 and in end-to-end FP8?

    python -m experiments.learning [--seeds 0,1,2] [--recipes configs/tiny_bf16.yaml,configs/tiny_fp8_e2e.yaml]
                                   [--out runs/learning] [key=value ...]      (overrides applied to every run)

For every recipe x seed: one ``fp8-grpo`` training run (``grpo.seed`` = the seed; each seed builds its own SFT warm
start, workers/bootstrap.py) as a child MLflow run of one parent run. Then, per recipe, the gain in validation
accuracy from step 0 to the last step, mean over seeds, with a 95% confidence interval from a paired bootstrap over
validation prompts with the seeds as strata (fp8core.stats), beside the format-valid rate, entropy, clip fractions
(updates after the first of each step), identical-reward groups and wall time. The markdown table goes to
``<out>/learning.md`` (quoted by the README) and to the parent run.

Resumable: a run whose ``learning.json`` marker (written after it finished) matches its recipe, seed and overrides
is skipped, and the parent run is reused (``<out>/parent.json``), so a rerun after an interruption only trains what
is missing. The tracking store is ``--tracking-uri``, else $MLFLOW_TRACKING_URI, else ``<out>/mlflow.db``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # as flows/grpo.py: Prefect reads its home at import, keep it under runs/
    from flows.cli_env import prefect_cli_env

    prefect_cli_env()

from prefect import flow  # noqa: E402

from configs.schema import load_config  # noqa: E402

RECIPES = ("configs/tiny_bf16.yaml", "configs/tiny_fp8_e2e.yaml")
SEEDS = (0, 1, 2)
EXPERIMENT = "fp8-grpo-learning"
# per-step training metrics summarised in the table (means over the run's steps unless said otherwise)
STEP_KEYS = ("reward/frac_groups_all_same", "train/dynamic_sampling_filtered_frac", "clip/lower_neg_adv_frac",
             "clip/upper_pos_adv_frac", "mismatch/token_mult_prob_error", "time/step_s")


def _marker(recipe: str, seed: int, overrides: list[str]) -> dict:
    return {"recipe": recipe, "seed": seed, "overrides": list(overrides)}


def finished(run_dir: Path, marker: dict) -> bool:
    """True when ``run_dir`` holds a run that completed with exactly this recipe, seed and overrides."""
    f = run_dir / "learning.json"
    if not f.exists():
        return False
    try:
        done = json.loads(f.read_text())
    except json.JSONDecodeError:
        return False
    return {k: done.get(k) for k in marker} == marker and (run_dir / "summary.json").exists()


def _parent(uri: str, root: Path, experiment: str, settings: dict) -> tuple[str, str]:
    """(run id, name) of the parent MLflow run of this experiment directory: reused when ``parent.json`` records the
    same settings and store (a resumed experiment), else a new one."""
    from mlflow.entities import Param, RunTag

    from tasks.tracking import client

    f = root / "parent.json"
    if f.exists():
        old = json.loads(f.read_text())
        if old.get("settings") == settings and old.get("tracking_uri") == uri:
            return old["run_id"], old["name"]
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment)
    name = f"learning-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    run_id = c.create_run(exp_id, run_name=name, tags={"kind": "learning"}).info.run_id
    c.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(settings.items())],
                tags=[RunTag("mlflow.note.content", "RL learning check: BF16 and end-to-end FP8, several seeds "
                                                    "(parent of the training runs; table in learning.md)")])
    f.write_text(json.dumps({"run_id": run_id, "name": name, "settings": settings, "tracking_uri": uri}, indent=1))
    return run_id, name


def _child_name(parent_name: str, recipe: str, seed: int) -> str:
    return f"{parent_name}-{Path(recipe).stem}-seed{seed}"


def run_dirs(root: Path, recipes, seeds) -> dict[tuple[str, int], Path]:
    """Seed-major order: every recipe of a seed right after its warm start is built (the SFT is per seed), so an
    interrupted experiment leaves complete seeds -- paired across recipes -- rather than a complete recipe."""
    return {(r, s): root / f"{Path(r).stem}-seed{s}" for s in seeds for r in recipes}


@flow(name="fp8-grpo-learning", log_prints=False, validate_parameters=True)
def learning(recipes: list[str] | None = None, seeds: list[int] | None = None, overrides: list[str] | None = None,
             out_dir: str = "runs/learning", experiment_name: str = EXPERIMENT, tracking_uri: str | None = None,
             n_boot: int = 10_000, train: bool = True) -> dict:
    from flows.grpo import grpo
    from tasks.tracking import client

    recipes = list(RECIPES) if recipes is None else list(recipes)
    seeds = list(SEEDS) if seeds is None else list(seeds)
    overrides = list(overrides or [])
    if not recipes or not seeds:
        raise ValueError("learning: needs at least one recipe and one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: duplicates in {seeds}")
    steps = set()
    for recipe in recipes:  # bad recipes / overrides fail here, before any training
        for seed in seeds:
            cfg = load_config(recipe, [*overrides, f"grpo.seed={seed}"])
            if not cfg.grpo.val_at_start:
                raise ValueError(f"grpo.val_at_start: {recipe} must validate at step 0 (the gain is measured from it)")
            steps.add(cfg.grpo.max_num_steps)
    root = Path(out_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    settings = {"recipes": list(recipes), "seeds": list(seeds), "overrides": overrides}
    parent, parent_name = _parent(uri, root, experiment_name, settings)
    print(f"learning: parent MLflow run {parent} ({parent_name}) at {uri}; {len(recipes)} recipes x "
          f"{len(seeds)} seeds", flush=True)
    status = "FAILED"
    try:
        for (recipe, seed), run_dir in run_dirs(root, recipes, seeds).items():
            marker = _marker(recipe, seed, overrides)
            if not train:
                continue
            if finished(run_dir, marker):
                print(f"learning: {run_dir.name} already finished, skipped", flush=True)
                continue
            name = _child_name(parent_name, recipe, seed)
            child = [*overrides, f"grpo.seed={seed}", f"run_dir={run_dir}", "checkpointing.resume=false",
                     "logger.mlflow_enabled=true", f"logger.mlflow.experiment_name={experiment_name}",
                     f"logger.mlflow.tracking_uri={uri}", f"logger.mlflow.run_name={name}"]
            print(f"learning: training {run_dir.name}", flush=True)
            summary = grpo(recipe, child)
            c = client(uri)
            c.set_tag(summary["mlflow_run_id"], "mlflow.parentRunId", parent)
            c.set_tag(summary["mlflow_run_id"], "learning.seed", str(seed))
            (run_dir / "learning.json").write_text(json.dumps({**marker, "mlflow_run_id": summary["mlflow_run_id"]}))
        done = {(r, sd) for (r, sd), d in run_dirs(root, recipes, seeds).items()
                if finished(d, _marker(r, sd, overrides))}
        table, rows = gain_table(root, recipes, seeds, uri, n_boot=n_boot, done=done)
        (root / "learning.md").write_text(table)
        (root / "learning.json").write_text(json.dumps(rows, indent=1))
        c = client(uri)
        c.log_text(parent, table, "learning.md")
        c.log_text(parent, json.dumps(rows, indent=1), "learning.json")
        print(table, flush=True)
        status = "FINISHED"
    finally:
        client(uri).set_terminated(parent, status=status)
    return {"parent_run_id": parent, "table": table, "rows": rows, "out_dir": str(root)}


def _history(c, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in c.get_metric_history(run_id, key)}


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _in_band(values, lo=0.005, hi=0.10) -> float:
    return _mean([1.0 if lo <= v <= hi else 0.0 for v in values])


def _val_correct(run_dir: Path, step: int) -> dict:
    """Per-prompt 0/1 correctness of the main validation set at ``step`` (run_dir/val/main/step_*.jsonl, named in
    summary.json, written by tasks/rl.py validate)."""
    files = json.loads((run_dir / "summary.json").read_text()).get("val_files", {}).get("main") or {}
    if str(step) not in files:
        raise FileNotFoundError(f"{run_dir}: no per-prompt validation file of step {step} in summary.json val_files")
    return {r["id"]: 1.0 if r["correct"] else 0.0 for r in map(json.loads, Path(files[str(step)]).read_text().splitlines())}


def recipe_row(root: Path, recipe: str, seeds, uri: str, *, n_boot: int = 10_000) -> dict:
    """One recipe's figures over its seeds (see the module docstring)."""
    from fp8core.stats import paired_bootstrap
    from tasks.tracking import client

    c = client(uri)
    start, end, seeds_out = [], [], []
    for seed in seeds:
        run_dir = root / f"{Path(recipe).stem}-seed{seed}"
        done = json.loads((run_dir / "learning.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        run_id = done["mlflow_run_id"]
        val_steps = sorted(int(k) for k in summary["val_accuracy"])
        first, last = val_steps[0], val_steps[-1]
        x, y = _val_correct(run_dir, first), _val_correct(run_dir, last)
        ids = sorted(set(x) & set(y), key=str)
        c0, c1 = [x[i] for i in ids], [y[i] for i in ids]
        start.append(c0)
        end.append(c1)
        fmt = _history(c, run_id, "val/format_valid")
        ent = _history(c, run_id, "policy/entropy")
        hist = {k: _history(c, run_id, k) for k in STEP_KEYS}
        train_steps = sorted(ent)
        seeds_out.append({
            "seed": seed, "run_dir": str(run_dir), "mlflow_run_id": run_id, "first_step": first, "last_step": last,
            "acc_start": sum(c0) / len(c0), "acc_end": sum(c1) / len(c1), "gain": (sum(c1) - sum(c0)) / len(c0),
            "format_valid_start": fmt.get(first), "format_valid_end": fmt.get(last),
            "entropy_first": ent[train_steps[0]] if train_steps else None,
            "entropy_last": ent[train_steps[-1]] if train_steps else None,
            **{f"mean {k}": _mean(hist[k].values()) for k in STEP_KEYS},
            "lower_neg_in_band": _in_band(hist["clip/lower_neg_adv_frac"].values()),
            "upper_pos_in_band": _in_band(hist["clip/upper_pos_adv_frac"].values()),
            "wall_s": summary.get("wall_s"), "val_prompts": len(c0),
            "val_curve": {int(k): v for k, v in summary["val_accuracy"].items()}})
    est = paired_bootstrap(start, end, n_boot=n_boot, shared_prompts=len({len(r) for r in start}) == 1)
    agg = {k: _mean(s[k] for s in seeds_out) for k in seeds_out[0] if isinstance(seeds_out[0][k], (int, float))
           and k not in ("seed", "first_step", "last_step")}
    steps = sorted(set.intersection(*(set(s["val_curve"]) for s in seeds_out)))
    curve = {st: _mean(s["val_curve"][st] for s in seeds_out) for st in steps}
    return {"recipe": recipe, "seeds": list(seeds), "gain": est.as_dict(), "mean": agg, "curve": curve,
            "per_seed": seeds_out}


def gain_table(root: Path, recipes, seeds, uri: str, *, n_boot: int = 10_000,
               done: set | None = None) -> tuple[str, list[dict]]:
    """The markdown table (and its rows) of every recipe's gain and health figures, over the seeds whose runs
    finished (``done``: (recipe, seed) pairs; None = all); a recipe with none is left out and named below."""
    rows, missing = [], []
    for r in recipes:
        have = [sd for sd in seeds if done is None or (r, sd) in done]
        missing += [f"{Path(r).stem} seed {sd}" for sd in seeds if sd not in have]
        if have:
            rows.append(recipe_row(root, r, have, uri, n_boot=n_boot))

    def pct(x):
        return f"{100 * x:.1f}%"

    lines = [
        "| recipe | val accuracy, first -> last validation (mean of seeds) | gain, points [95% CI] | per-seed gains "
        "| val accuracy at each validation (step: mean of seeds) "
        "| format-valid | entropy, first -> last step | clip low/neg-A, up/pos-A (updates after the first; steps in "
        "0.5-10%) | identical-reward groups | filtered by dynamic sampling | mean step | run wall time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        m, g = row["mean"], row["gain"]
        per = ", ".join(f"{100 * s['gain']:+.1f}" for s in row["per_seed"])
        lines.append(
            f"| `{row['recipe']}` | {m['acc_start']:.3f} -> {m['acc_end']:.3f} ({int(m['val_prompts'])} prompts, "
            f"seeds {', '.join(map(str, row['seeds']))}) | **{100 * g['value']:+.1f}** [{100 * g['lo']:+.1f}, "
            f"{100 * g['hi']:+.1f}] | {per} (sd {100 * g['seed_sd']:.1f}) | "
            f"{' / '.join(f'{st}: {v:.3f}' for st, v in row['curve'].items())} | {m['format_valid_start']:.3f} -> "
            f"{m['format_valid_end']:.3f} | {m['entropy_first']:.3f} -> {m['entropy_last']:.3f} | "
            f"{pct(m['mean clip/lower_neg_adv_frac'])} ({pct(m['lower_neg_in_band'])} of steps), "
            f"{pct(m['mean clip/upper_pos_adv_frac'])} ({pct(m['upper_pos_in_band'])}) | "
            f"{pct(m['mean reward/frac_groups_all_same'])} | {pct(m['mean train/dynamic_sampling_filtered_frac'])} | "
            f"{m['mean time/step_s']:.1f} s | {m['wall_s']:.0f} s |")
    lines.append("")
    if missing:
        lines.append(f"Not finished (not in the table): {', '.join(missing)}.")
    lines.append("Gain: mean over seeds of the per-prompt change in near-greedy validation correctness (same prompts "
                 "at both ends); CI: paired bootstrap over prompts with seeds as strata (fp8core.stats."
                 f"paired_bootstrap, {n_boot} replicates).")
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m experiments.learning", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe files")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated integers")
    ap.add_argument("--out", default="runs/learning", help="experiment directory (resumable)")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--table-only", action="store_true", help="no training: the table of the runs finished so far")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value, applied to every run")
    a = ap.parse_args(argv)
    from configs.schema import ConfigError
    from fp8core.cpu import apply_cpu_cap

    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"--seeds: comma-separated integers expected, got {a.seeds!r}", file=sys.stderr)
        return 2
    recipes = [r for r in a.recipes.split(",") if r.strip()]
    try:
        for r in recipes:
            load_config(r, [*a.overrides, f"grpo.seed={seeds[0] if seeds else 0}"])
        apply_cpu_cap()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    learning(recipes, seeds, a.overrides, a.out, tracking_uri=a.tracking_uri, n_boot=a.n_boot, train=not a.table_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
