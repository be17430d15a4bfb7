"""Experiment ``fp8-grpo-learning``: does RL learn on the embedded workload, in BF16 and in end-to-end FP8?

    python -m experiments.learning [--seeds 0,1,2] [--recipes configs/tiny_bf16.yaml,configs/tiny_fp8_e2e.yaml]
                                   [--out runs/learning] [key=value ...]      (overrides applied to every run)

For every recipe x seed: one ``fp8-grpo`` training run (``grpo.seed`` = the seed, all on the grid's shared SFT warm
start, ``bootstrap.sft_seed``: experiments/grid.py) as a child MLflow run of one parent run. Then, per recipe, the gain in validation
accuracy from step 0 to the last step, mean over seeds, with a 95% confidence interval from a paired bootstrap over
validation prompts with the seeds as strata (fp8core.stats), beside the format-valid rate, entropy, clip fractions
(updates after the first of each step), identical-reward groups and wall time; with several seeds, the seed SD of
the gain and the seeds a 3-point difference between two arms would need (``seeds_line``). The markdown table goes to
``<out>/learning.md`` and to the parent run; when it finishes, ``main`` writes it, stamped (commit, date, CPU,
command line: tools.results), to docs/results/learning.md (``--results-doc PATH``; ``--no-results-doc`` for none).

Resumable: a run whose ``learning.json`` marker (written after it finished) matches its recipe, seed and overrides
is skipped, and the parent run is reused (``<out>/parent.json``), so a rerun after an interruption only trains what
is missing. The tracking store is ``--tracking-uri``, else $MLFLOW_TRACKING_URI, else ``<out>/mlflow.db``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

if __name__ == "__main__":  # as flows/grpo.py: Prefect reads its home at import, keep it under runs/
    from flows.cli_env import prefect_cli_env

    prefect_cli_env()

from prefect import flow  # noqa: E402

import process.quiet  # noqa: E402,F401  third-party start-up noise off (process/quiet.py)
from configs.schema import load_config  # noqa: E402
from experiments.grid import Arm, Grid, history, log_report, mean, run_grid, val_correct  # noqa: E402
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result  # noqa: E402

RECIPES = ("configs/tiny_bf16.yaml", "configs/tiny_fp8_e2e.yaml")
SEEDS = (0, 1, 2)
EXPERIMENT = "fp8-grpo-learning"
# per-step training metrics summarised in the table (means over the run's steps unless said otherwise)
STEP_KEYS = ("reward/frac_groups_all_same", "train/dynamic_sampling_filtered_frac", "clip/lower_neg_adv_frac",
             "clip/upper_pos_adv_frac", "mismatch/token_mult_prob_error", "time/step_s")


def _marker(recipe: str, seed: int, overrides: list[str]) -> dict:
    return {"recipe": recipe, "seed": seed, "overrides": list(overrides)}


MARKER = "learning.json"


def make_grid(recipes, seeds, overrides, out_dir) -> Grid:
    """One arm per recipe (named by the recipe's stem, no arm overrides): the runs live in ``<out>/<stem>-seed<k>``."""
    recipes, seeds, overrides = list(recipes), list(seeds), list(overrides)
    return Grid(arms=tuple(Arm(Path(r).stem, r) for r in recipes), seeds=tuple(seeds), root=Path(out_dir).resolve(),
                common=tuple(overrides), kind="learning", marker_name=MARKER,
                note="RL learning check: BF16 and end-to-end FP8, several seeds (parent of the training runs; table "
                     "in learning.md)",
                settings={"recipes": recipes, "seeds": seeds, "overrides": overrides})


@flow(name="fp8-grpo-learning", log_prints=False, validate_parameters=True)
def learning(recipes: list[str] | None = None, seeds: list[int] | None = None, overrides: list[str] | None = None,
             out_dir: str = "runs/learning", experiment_name: str = EXPERIMENT, tracking_uri: str | None = None,
             n_boot: int = 10_000, train: bool = True) -> dict:
    recipes = list(RECIPES) if recipes is None else list(recipes)
    seeds = list(SEEDS) if seeds is None else list(seeds)
    if not recipes or not seeds:
        raise ValueError("learning: needs at least one recipe and one seed")
    grid = make_grid(recipes, seeds, overrides or [], out_dir)
    for name, cfg in grid.check_configs().items():  # the gain is measured from step 0
        if not cfg.grpo.val_at_start:
            raise ValueError(f"grpo.val_at_start: {name} must validate at step 0 (the gain is measured from it)")

    def report(g: Grid, uri: str, parent: str) -> dict:
        done = {(a.recipe, s) for a, s in g.cells() if (a.name, s) in g.done()}
        table, rows = gain_table(g.root, recipes, seeds, uri, n_boot=n_boot, done=done)
        log_report(uri, parent, g.root, {"learning.md": table, "learning.json": json.dumps(rows, indent=1)})
        print(table, flush=True)
        return {"table": table, "rows": rows}

    return run_grid(grid, experiment=experiment_name, tracking_uri=tracking_uri, train=train, report=report)


def _in_band(values, lo=0.005, hi=0.10) -> float:
    return mean([1.0 if lo <= v <= hi else 0.0 for v in values])


def recipe_row(root: Path, recipe: str, seeds, uri: str, *, n_boot: int = 10_000) -> dict:
    """One recipe's figures over its seeds (see the module docstring)."""
    from fp8core.stats import paired_bootstrap
    from tasks.tracking import client

    c = client(uri)
    start, end, seeds_out = [], [], []
    for seed in seeds:
        run_dir = root / f"{Path(recipe).stem}-seed{seed}"
        done = json.loads((run_dir / MARKER).read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        run_id = done["mlflow_run_id"]
        val_steps = sorted(int(k) for k in summary["val_accuracy"])
        first, last = val_steps[0], val_steps[-1]
        x, y = val_correct(run_dir, first), val_correct(run_dir, last)
        ids = sorted(set(x) & set(y), key=str)
        c0, c1 = [x[i] for i in ids], [y[i] for i in ids]
        start.append(c0)
        end.append(c1)
        fmt = history(c, run_id, "val/format_valid")
        ent = history(c, run_id, "policy/entropy")
        hist = {k: history(c, run_id, k) for k in STEP_KEYS}
        train_steps = sorted(ent)
        seeds_out.append({
            "seed": seed, "run_dir": str(run_dir), "mlflow_run_id": run_id, "first_step": first, "last_step": last,
            "acc_start": sum(c0) / len(c0), "acc_end": sum(c1) / len(c1), "gain": (sum(c1) - sum(c0)) / len(c0),
            "format_valid_start": fmt.get(first), "format_valid_end": fmt.get(last),
            "entropy_first": ent[train_steps[0]] if train_steps else None,
            "entropy_last": ent[train_steps[-1]] if train_steps else None,
            **{f"mean {k}": mean(hist[k].values()) for k in STEP_KEYS},
            "lower_neg_in_band": _in_band(hist["clip/lower_neg_adv_frac"].values()),
            "upper_pos_in_band": _in_band(hist["clip/upper_pos_adv_frac"].values()),
            "wall_s": summary.get("wall_s"), "val_prompts": len(c0),
            "val_curve": {int(k): v for k, v in summary["val_accuracy"].items()}})
    est = paired_bootstrap(start, end, n_boot=n_boot, shared_prompts=len({len(r) for r in start}) == 1)
    agg = {k: mean(s[k] for s in seeds_out) for k in seeds_out[0] if isinstance(seeds_out[0][k], (int, float))
           and k not in ("seed", "first_step", "last_step")}
    steps = sorted(set.intersection(*(set(s["val_curve"]) for s in seeds_out)))
    curve = {st: mean(s["val_curve"][st] for s in seeds_out) for st in steps}
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
    for row in rows:
        if len(row["per_seed"]) > 1 and row["gain"]["seed_sd"] > 0:
            lines.append(seeds_line(row) + "\n")
    if missing:
        lines.append(f"Not finished (not in the table): {', '.join(missing)}.")
    lines.append("Gain: mean over seeds of the per-prompt change in near-greedy validation correctness (same prompts "
                 "at both ends); CI: paired bootstrap over prompts with seeds as strata (fp8core.stats."
                 f"paired_bootstrap, {n_boot} replicates).")
    return "\n".join(lines) + "\n", rows


DETECT = 0.03  # the difference between two arms' gains the seeds-needed line is sized for (3 points)


def seeds_line(row: dict, effect: float = DETECT) -> str:
    """How many seeds a difference of ``effect`` between two arms would need, from this recipe's seed SD of the gain
    ``s``: two arms' paired per-seed difference has SD ``sqrt(2) * s`` when their runs are independent given the warm
    start (positively correlated runs need fewer); fp8core.stats.seeds_needed at 80% power, 5% one-sided."""
    from fp8core.stats import seeds_needed

    sd = row["gain"]["seed_sd"]
    n = seeds_needed(sd_per_seed=math.sqrt(2) * sd, effect=effect)
    return (f"`{row['recipe']}`: seed SD of the gain {100 * sd:.1f} points over {len(row['per_seed'])} seeds; a "
            f"{100 * effect:.0f}-point difference between two arms then needs {n} paired seeds (per-seed difference "
            f"SD sqrt(2) x {100 * sd:.1f}, `fp8core.stats.seeds_needed`, 80% power, 5% one-sided).")


NOTE = "What is measured and how to read it: [experiments](../experiments.md#does-rl-learn-the-learning-experiment)."


def write_results_doc(result: dict, origin: dict, path: str | Path | None = None) -> Path:
    """The stamped results file of a finished :func:`learning` (``result``: what it returned; ``origin``:
    tools.results.stamp taken when the command started)."""
    details = [f"- experiment directory: `{shown(result['out_dir'])}`; MLflow parent run "
               f"`{result['parent_run_id']}`"]
    details += result.get("provenance", [])  # every invocation behind the runs (a resumed grid)
    return write_result("learning", "Learning experiment: results", result["table"], origin, note=NOTE,
                        details=details, path=path)


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
    add_results_doc_args(ap, "learning")
    argv = list(sys.argv[1:] if argv is None else argv)
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
    origin = stamp("experiments.learning", argv)  # the code that runs, before the (hours of) training
    out = learning(recipes, seeds, a.overrides, a.out, tracking_uri=a.tracking_uri, n_boot=a.n_boot,
                   train=not a.table_only)
    doc = results_doc(a)
    if doc is not None and out["rows"]:
        print(f"learning: results written to {write_results_doc(out, origin, doc)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
