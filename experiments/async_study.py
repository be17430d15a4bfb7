"""Experiment ``fp8-grpo-async``: does asynchronous GRPO learn as well as synchronous, in end-to-end FP8?

    python -m experiments.async_study [--seeds 0,1,2] [--recipe configs/tiny_fp8_e2e.yaml] [--age 1]
                                      [--out runs/async_study] [key=value ...]   (overrides applied to every run)

Two arms on the same recipe, seeds and prompts: ``sync`` (grpo.async_grpo.enabled=false) and ``async``
(grpo.async_grpo.enabled=true, max_trajectory_age_steps = ``--age``), each run the default number of steps of the
recipe (experiments.grid: child MLflow runs of one parent, resumable). The table: validation accuracy at step 0 and
at the last step per arm (mean over seeds, bootstrap CI over prompts with the seeds as strata), async - sync at the
last step paired on the same prompts and seeds, and per arm (t interval over the seeds' run means) the trajectory age,
the importance weight's mean, the mismatch, the step time and the step interval. Written to docs/results/async-accuracy.md
(``--results-doc``), stamped.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # as flows/grpo.py: Prefect reads its home at import, keep it under runs/
    from flows.cli_env import prefect_cli_env

    prefect_cli_env()

from prefect import flow  # noqa: E402

import process.quiet  # noqa: E402,F401
from configs.schema import load_config  # noqa: E402
from experiments.grid import (  # noqa: E402
    VS_HEADER,
    Arm,
    Grid,
    accuracy_curve,
    accuracy_vs,
    collect,
    fmt_ci,
    fmt_vs,
    log_report,
    metric_summary,
    run_grid,
    seed_t_interval,
)
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result  # noqa: E402

EXPERIMENT = "fp8-grpo-async"
STEP_KEYS = ("async/trajectory_age_mean", "is/weight_mean", "mismatch/token_mult_prob_error", "time/step_s")


def make_grid(recipe: str, seeds, age: int, overrides, out_dir) -> Grid:
    arms = (Arm("sync", recipe, ("grpo.async_grpo.enabled=false",)),
            Arm("async", recipe, ("grpo.async_grpo.enabled=true", f"grpo.async_grpo.max_trajectory_age_steps={age}")))
    return Grid(arms=arms, seeds=tuple(seeds), root=Path(out_dir).resolve(), common=tuple(overrides),
                kind="async", marker_name="async.json",
                note="Asynchronous vs synchronous GRPO (parent of the training runs; table in async.md)")


def table(g: Grid, uri: str, *, n_boot: int) -> tuple[str, list[dict]]:
    arms, missing = collect(g, uri, STEP_KEYS)
    by = {a.arm.name: a for a in arms}
    rows = []
    lines = ["| arm | seeds | val acc step 0 | val acc last step | vs sync, " + VS_HEADER + " | trajectory age | IS weight "
             "mean | mismatch | step (s) | step interval (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        curve = accuracy_curve(a, n_boot=n_boot)
        first, last = curve[min(curve)], curve[max(curve)]
        vs = accuracy_vs(by["sync"], a, n_boot=n_boot) if a.arm.name != "sync" and "sync" in by else None
        stats = {k: metric_summary(a, k) for k in STEP_KEYS}
        interval = seed_t_interval([s.get("step_interval_s") for s in a.summaries])
        rows.append({"arm": a.arm.name, "seeds": a.seeds, "start": first, "end": last, "vs_sync": vs,
                     **{k: v for k, v in stats.items()}, "step_interval_s": interval})
        lines.append(f"| {a.arm.name} | {','.join(map(str, a.seeds))} | {fmt_ci(first)} | {fmt_ci(last)} | "
                     f"{fmt_vs(vs) if vs else '-'} | "
                     f"{fmt_ci(stats['async/trajectory_age_mean'], digits=2)} | "
                     f"{fmt_ci(stats['is/weight_mean'], digits=4)} | "
                     f"{fmt_ci(stats['mismatch/token_mult_prob_error'], digits=4)} | "
                     f"{fmt_ci(stats['time/step_s'], digits=2)} | {fmt_ci(interval, digits=2)} |")
    if missing:
        lines.append(f"\nNot finished: {', '.join(missing)}.")
    return "\n".join(lines), rows


@flow(name="fp8-grpo-async-study", log_prints=False, validate_parameters=True)
def async_study(recipe: str = "configs/tiny_fp8_e2e.yaml", seeds: list[int] | None = None, age: int = 1,
                overrides: list[str] | None = None, out_dir: str = "runs/async_study",
                tracking_uri: str | None = None, n_boot: int = 10_000, train: bool = True) -> dict:
    grid = make_grid(recipe, seeds or [0, 1, 2], age, overrides or [], out_dir)
    for name, cfg in grid.check_configs().items():
        if not cfg.grpo.val_at_start:
            raise ValueError(f"grpo.val_at_start: {name} must validate at step 0")

    def report(g: Grid, uri: str, parent: str) -> dict:
        text, rows = table(g, uri, n_boot=n_boot)
        log_report(uri, parent, g.root, {"async.md": text, "async.json": json.dumps(rows, indent=1, default=str)})
        print(text, flush=True)
        return {"table": text, "rows": rows}

    return run_grid(grid, experiment=EXPERIMENT, tracking_uri=tracking_uri, train=train, report=report)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m experiments.async_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="configs/tiny_fp8_e2e.yaml")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated integers")
    ap.add_argument("--age", type=int, default=1, help="grpo.async_grpo.max_trajectory_age_steps of the async arm")
    ap.add_argument("--out", default="runs/async_study", help="experiment directory (resumable)")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--table-only", action="store_true", help="no training: the table of the runs finished so far")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value, applied to every run")
    add_results_doc_args(ap, "async-accuracy")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    from configs.schema import ConfigError

    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        if not seeds:
            raise ValueError("--seeds: at least one seed")
        load_config(a.recipe, [*a.overrides, "grpo.async_grpo.enabled=true",
                               f"grpo.async_grpo.max_trajectory_age_steps={a.age}"])
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    origin = stamp("experiments.async_study", argv)
    out = async_study(a.recipe, seeds, a.age, a.overrides, a.out, tracking_uri=a.tracking_uri, n_boot=a.n_boot,
                      train=not a.table_only)
    doc = results_doc(a)
    if doc is not None and out["rows"]:
        note = ("Asynchronous GRPO against synchronous on the same recipe, seeds and validation prompts: accuracy "
                "(bootstrap CI over prompts, seeds as strata), the paired difference at the last step, and per-step "
                "means with t intervals over the seeds.")
        print(f"results: {shown(write_result('async-accuracy', 'Asynchronous GRPO: accuracy', out['table'], origin, note=note, details=out.get('provenance', []), path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
