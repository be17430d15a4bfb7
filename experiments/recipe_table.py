"""Experiment ``fp8-grpo-recipe-table``: the FP8 recipe table of NVIDIA's FP8 RL blog on the embedded workload.

    python -m experiments.recipe_table [--seeds 0,1,2] [--arms bf16,fp8-e2e,...] [--out runs/recipe_table]
                                       [--table-only] [key=value ...]      (overrides applied to every run)

Arms (``ARMS``; each a recipe + overrides, all inheriting configs/tiny_bf16.yaml's workload, batch and steps):

- ``bf16``: BF16 rollouts, FP32 trainer (configs/tiny_bf16.yaml);
- ``fp8-rollout-no-is``: FP8 (blockwise) rollouts, high-precision trainer, no importance-sampling correction
  (configs/tiny_fp8_rollout.yaml + ``loss_fn.use_importance_sampling_correction=false``);
- ``fp8-rollout-tis``: the same with truncated importance sampling (configs/tiny_fp8_rollout.yaml);
- ``fp8-e2e``: end-to-end FP8, rollouts and training (configs/tiny_fp8_e2e.yaml);
- ``fp8-e2e-kv``: end-to-end FP8 + FP8 KV cache with per-step K/V scales (configs/tiny_fp8_e2e_kv.yaml);
- ``fp8-e2e-kv-replay``: the same, the trainer rounding K/V like the engine's cache
  (``calibration.kv_rounding_in_trainer=true``).

For every arm x seed one ``fp8-grpo`` run, a child MLflow run of one parent (experiments/grid.py: resumable, a rerun
skips finished runs). The table (``<out>/recipe_table.md``, logged to the parent with the PNG plots under
``<out>/plots``): per arm, validation accuracy at every validation and at the last one (mean of seeds, 95% CI from a
bootstrap over prompts with seeds as strata), its difference to BF16 paired on the same prompts and seeds, mean
``mismatch/token_mult_prob_error`` and mean step time (mean of the per-seed means, 95% t interval over seeds; no
interval with one seed).

When it finishes, ``main`` writes the table and the figure, stamped (commit, date, CPU, command line: tools.results),
to docs/results/recipe_table.md (``--results-doc PATH``; ``--no-results-doc`` for none) and copies the PNG to
docs/img/.
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
from experiments.grid import (  # noqa: E402
    VS_HEADER,
    Arm,
    ArmRuns,
    Grid,
    accuracy_curve,
    accuracy_vs,
    as_points,
    collect,
    fmt_ci,
    fmt_vs,
    log_report,
    metric_curve,
    metric_summary,
    parse_ints,
    plot_curves,
    run_grid,
)
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result  # noqa: E402

EXPERIMENT = "fp8-grpo-recipe-table"
SEEDS = (0, 1, 2)
ARMS = (
    Arm("bf16", "configs/tiny_bf16.yaml", label="BF16"),
    Arm("fp8-rollout-no-is", "configs/tiny_fp8_rollout.yaml", ("loss_fn.use_importance_sampling_correction=false",),
        label="FP8 rollout only, no IS"),
    Arm("fp8-rollout-tis", "configs/tiny_fp8_rollout.yaml", label="FP8 rollout only + TIS"),
    Arm("fp8-e2e", "configs/tiny_fp8_e2e.yaml", label="end-to-end FP8"),
    Arm("fp8-e2e-kv", "configs/tiny_fp8_e2e_kv.yaml", label="end-to-end FP8 + FP8 KV cache"),
    Arm("fp8-e2e-kv-replay", "configs/tiny_fp8_e2e_kv.yaml", ("calibration.kv_rounding_in_trainer=true",),
        label="end-to-end FP8 + FP8 KV cache, replayed in the trainer"),
)
KEYS = ("mismatch/token_mult_prob_error", "time/step_s", "time/rollout_s", "time/train_s")


def select_arms(names: list[str] | None) -> tuple[Arm, ...]:
    """The arms named (all when None), in ``ARMS`` order; an unknown name fails naming the valid ones."""
    if names is None:
        return ARMS
    known = {a.name: a for a in ARMS}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"--arms: unknown arm(s) {bad} (valid: {', '.join(known)})")
    return tuple(a for a in ARMS if a.name in names)


def make_grid(arms, seeds, overrides, out_dir) -> Grid:
    return Grid(arms=tuple(arms), seeds=tuple(seeds), root=Path(out_dir).resolve(), common=tuple(overrides),
                kind="recipe_table", marker_name="recipe_table.json",
                note="FP8 recipe table (BF16 / FP8 rollout without and with TIS / end-to-end FP8 / + FP8 KV cache): "
                     "parent of the training runs; table in recipe_table.md, plots under plots/")


def rows(runs: list[ArmRuns], *, n_boot: int = 2000) -> list[dict]:
    """One dict per arm with its figures (see the module docstring); the first arm is the reference of the
    differences."""
    out = []
    ref = runs[0] if runs else None
    for a in runs:
        curve = accuracy_curve(a, n_boot=n_boot)
        last = a.last_val_step
        out.append({
            "arm": a.arm.name, "label": a.arm.label, "recipe": a.arm.recipe, "overrides": list(a.arm.overrides),
            "seeds": a.seeds, "mlflow_run_ids": a.run_ids, "val_prompts": curve[last]["n"] // len(a.seeds),
            "curve": curve, "last_step": last, "acc_last": curve[last],
            "vs_ref": None if a is ref else accuracy_vs(ref, a, n_boot=n_boot), "ref": ref.arm.name,
            "token_mult_prob_error": metric_summary(a, "mismatch/token_mult_prob_error"),
            "step_s": metric_summary(a, "time/step_s"),
            "rollout_s": metric_summary(a, "time/rollout_s"), "train_s": metric_summary(a, "time/train_s"),
            "wall_s": sum(s["wall_s"] for s in a.summaries) / len(a.summaries)})
    return out


def table(rs: list[dict], missing: list[str], *, n_boot: int) -> str:
    lines = ["| arm | seeds | val accuracy, last validation [95% CI] | vs " + (rs[0]["label"] if rs else "ref")
             + ", " + VS_HEADER + " | val accuracy at each validation (step: mean of seeds) | token_mult_prob_error "
             "[95% CI] | step time [95% CI] (rollout / train) | run wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rs:
        vs = "(reference)" if r["vs_ref"] is None else (
            f"{fmt_vs(r['vs_ref'])} (seeds {', '.join(map(str, r['vs_ref']['seeds']))})")
        curve = " / ".join(f"{st}: {e['value']:.3f}" for st, e in r["curve"].items())
        lines.append(
            f"| {r['label']} (`{r['arm']}`) | {', '.join(map(str, r['seeds']))} | "
            f"{fmt_ci(r['acc_last'])} (step {r['last_step']}, {r['val_prompts']} prompts) | {vs} | {curve} | "
            f"{fmt_ci(r['token_mult_prob_error'], digits=5)} | {fmt_ci(r['step_s'], digits=1)} s "
            f"({r['rollout_s']['value']:.1f} / {r['train_s']['value']:.1f}) | {r['wall_s']:.0f} s |")
    lines.append("")
    if missing:
        lines.append(f"Not finished (not in the table): {', '.join(missing)}.")
    lines.append("Accuracy: near-greedy validation on the main set, mean over seeds, CI from a bootstrap over prompts "
                 "with seeds as strata; the difference is paired on the same prompts and seeds (fp8core.stats."
                 f"paired_bootstrap, {n_boot} replicates). token_mult_prob_error and step time: mean over the run's "
                 "steps per seed, then over seeds, with a t interval over seeds (none with one seed).")
    return "\n".join(lines) + "\n"


def plots(runs: list[ArmRuns], rs: list[dict], plot_dir: Path) -> list[Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    acc = {r["label"]: as_points(r["curve"]) for r in rs}
    mism = {a.arm.label: metric_curve(a, "mismatch/token_mult_prob_error", band="range", shift=1.0) for a in runs}
    step = {a.arm.label: metric_curve(a, "time/step_s", band="range") for a in runs}
    return [plot_curves(plot_dir / "recipe_table.png",
                        "FP8 recipes on the embedded workload (mean of seeds; accuracy band: 95% CI over prompts, "
                        "other bands: range over seeds)",
                        [("validation accuracy", acc), ("token_mult_prob_error - 1 (log)", mism, {"yscale": "log"}),
                         ("step time (s)", step)])]


def report(grid: Grid, uri: str, parent: str, *, n_boot: int = 2000) -> dict:
    runs, missing = collect(grid, uri, KEYS)
    rs = rows(runs, n_boot=n_boot)
    md = table(rs, missing, n_boot=n_boot)
    figs = plots(runs, rs, grid.root / "plots") if runs else []
    log_report(uri, parent, grid.root, {"recipe_table.md": md,
                                        "recipe_table.json": json.dumps(rs, indent=1, default=_json_default)}, figs)
    print(md, flush=True)
    return {"table": md, "rows": rs, "plots": [str(f) for f in figs]}


def _json_default(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


NOTE = ("What the arms are and how to read the table: "
        "[experiments](../experiments.md#the-recipe-table-nvidias-fp8-rl-blog).")
FIGURE = ("![recipe table curves](../img/recipe_table.png)\n\n"
          "`plots/recipe_table.png` of the command above: mean of seeds; the accuracy band is the 95% CI over prompts, "
          "the other bands the range over the seeds. The mismatch is drawn as `token_mult_prob_error - 1` on a log "
          "axis.")


def write_results_doc(result: dict, origin: dict, path: str | Path | None = None) -> Path:
    """The stamped results file of a finished :func:`recipe_table` (``result``: what it returned; ``origin``:
    tools.results.stamp taken when the command started): the table and the figure, copied to ``../img/``."""
    plots = [Path(p) for p in result.get("plots", [])]
    details = [f"- experiment directory: `{shown(result['out_dir'])}`; MLflow parent run "
               f"`{result['parent_run_id']}`"]
    details += result.get("provenance", [])  # every invocation behind the runs (a resumed grid)
    body = result["table"] + ("\n" + FIGURE if plots else "")
    return write_result("recipe_table", "Recipe table: results", body, origin, note=NOTE, details=details,
                        path=path, images=plots)


@flow(name="fp8-grpo-recipe-table", log_prints=False, validate_parameters=True)
def recipe_table(arms: list[str] | None = None, seeds: list[int] | None = None, overrides: list[str] | None = None,
                 out_dir: str = "runs/recipe_table", experiment_name: str = EXPERIMENT,
                 tracking_uri: str | None = None, n_boot: int = 2000, train: bool = True) -> dict:
    grid = make_grid(select_arms(arms), list(SEEDS) if seeds is None else seeds, overrides or [], out_dir)
    return run_grid(grid, experiment=experiment_name, tracking_uri=tracking_uri, train=train,
                    report=lambda g, uri, parent: report(g, uri, parent, n_boot=n_boot))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m experiments.recipe_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=None, help=f"comma-separated subset of {', '.join(a.name for a in ARMS)}")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated integers")
    ap.add_argument("--out", default="runs/recipe_table", help="experiment directory (resumable)")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--table-only", action="store_true", help="no training: the table of the runs finished so far")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value, applied to every run")
    add_results_doc_args(ap, "recipe_table")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    from configs.schema import ConfigError
    from fp8core.cpu import apply_cpu_cap

    try:
        seeds = parse_ints(a.seeds, "--seeds")
        arms = select_arms(None if a.arms is None else [s.strip() for s in a.arms.split(",") if s.strip()])
        make_grid(arms, seeds, a.overrides, a.out).check_configs()
        apply_cpu_cap()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    origin = stamp("experiments.recipe_table", argv)  # the code that runs, before the (hours of) training
    out = recipe_table([x.name for x in arms], seeds, a.overrides, a.out, tracking_uri=a.tracking_uri,
                       n_boot=a.n_boot, train=not a.table_only)
    doc = results_doc(a)
    if doc is not None and out["rows"]:
        print(f"recipe_table: results written to {write_results_doc(out, origin, doc)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
