"""Scaling figures: the real flow (``python -m flows.grpo``: Prefect, Ray actors, vLLM, MLflow) for
several worker layouts, one run after the other on the same model, prompts, batch and seed, read back from MLflow.

    .venv/bin/python -m bench.scaling --layouts 1+1,2+1,1+2,2+2 --steps 5
    .venv/bin/python -m bench.scaling --layouts 1+1 --baseline-tree /tmp/old-checkout --repeats 2

A layout ``N+M`` is N rollout engines (``cluster.rollout_workers``) and M data-parallel trainers
(``cluster.policy_workers``). Per layout: the median over steps 2..K of the step time, the rollout and train times,
rollout tokens/s, the driver's refit wall and the per-engine refit (mean / slowest). On a 2-core machine every layout
shares the same 2 cores: the figures show the overheads of more workers, not a speed-up.

``--baseline-tree DIR`` also runs the 1+1 layout from another checkout of the project (e.g. the commit before the
scale-out work), interleaved with this tree's 1+1 runs in ABBA order (baseline, head, head, baseline, ...
``--repeats`` pairs), and prints this tree's 1+1 step time over the baseline's (the check that the
scale-out code adds at most 5% to a 1+1 step):
the ratio of the medians, and a drift-corrected ratio with its 95% interval (least squares on log step time with a
run-order trend and a head/baseline term: on these machines step times drifted ~3% per run, which an A B A B order
would charge to whichever tree runs second). A layout whose flow fails is reported as a failed row (its error
printed), and the bench goes on with the next one. Overrides after the options apply to every run (``key=value``).
When it finishes, the table (and the baseline line), stamped (commit, date, CPU, command line: tools.results), go to
docs/results/scaling.md (``--results-doc PATH``; ``--no-results-doc`` for none).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "runs" / "test-env" / "ops-assets"
KEYS = ("time/step_s", "time/rollout_s", "time/train_s", "throughput/rollout_tokens_per_s", "time/refit_s",
        "time/refit_engine_mean_s", "time/refit_engine_s")


def base_overrides(model_dir: Path, data_dir: Path, steps: int) -> list[str]:
    """The workload: the tests' 30-step SFT model on the addition task, 16 prompts x 8 samples x <= 64 tokens
    (the tiny recipes' batch), no validation beyond a 16-prompt end check, no checkpoints (dynamic sampling is
    turned off per tree in ``run_layout``: every layout, and an older checkout without the key, trains on every
    group)."""
    return [f"policy.model_name={model_dir}", f"data.train_path={data_dir / 'train.jsonl'}",
            f"data.validation_path={data_dir / 'validation.jsonl'}", f"grpo.max_num_steps={steps}",
            "grpo.val_at_start=false", "grpo.val_period=0", "grpo.max_val_samples=16", "evaluation.num_samples=0",
            "evaluation.sets=[]", "checkpointing.enabled=false"]


def run_layout(tree: Path, recipe: str, overrides: list[str], n: int, m: int, tag: str, out: Path) -> dict:
    from mlflow.tracking import MlflowClient

    run_dir = out / tag
    uri = f"sqlite:///{out / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "flows.grpo", str(tree / recipe), *overrides, f"run_dir={run_dir}",
           f"logger.mlflow.tracking_uri={uri}"]
    # the layout keys only where they differ from the default (an older checkout may not know them), and dynamic
    # sampling off where the tree has it (older trees train on every group)
    cmd += [f"cluster.rollout_workers={n}"] * (n != 1) + [f"cluster.policy_workers={m}"] * (m != 1)
    if "dynamic_sampling" in (tree / "configs" / "schema.py").read_text():
        cmd.append("grpo.dynamic_sampling=false")
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(tree), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{tag}: flow failed (rc {r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}"
                           f"\n{r.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    c = MlflowClient(tracking_uri=uri)

    def med(key: str) -> float | None:
        vals = [x.value for x in sorted(c.get_metric_history(summary["mlflow_run_id"], key), key=lambda x: x.step)]
        vals = vals[1:] or vals  # steps 2..K: step 1 carries the first-call compiles
        return statistics.median(vals) if vals else None

    return {"layout": f"{n}+{m}", "tree": str(tree), "wall_s": time.perf_counter() - t0,
            "mlflow_run_id": summary["mlflow_run_id"], **{k: med(k) for k in KEYS}}


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    lines = ["| engines + trainers | step s | rollout s | rollout tokens/s | refit s (driver) | refit per engine s "
             "(mean / slowest) | train s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['layout']} | failed: {r['failed']} | | | | | |")
            continue
        lines.append(f"| {r['layout']} | {_fmt(r['time/step_s'])} | {_fmt(r['time/rollout_s'])} | "
                     f"{_fmt(r['throughput/rollout_tokens_per_s'], '.0f')} | {_fmt(r['time/refit_s'])} | "
                     f"{_fmt(r['time/refit_engine_mean_s'])} / {_fmt(r['time/refit_engine_s'])} | "
                     f"{_fmt(r['time/train_s'])} |")
    return "\n".join(lines)


NOTE = ("What is measured and how to read it: [performance](../performance.md#scaling-more-engines-and-trainers). "
        "Every layout shares this machine's cores: on a few cores the figures are overheads, not speed-ups.")


def write_results_doc(rows: list[dict], baseline: str | None, origin: dict, *, recipe: str, steps: int, out: Path,
                      path: str | Path | None = None) -> Path:
    """The stamped results file of a scaling run: the layout table of ``rows`` and the ``baseline`` comparison line
    (None without ``--baseline-tree``); ``origin``: tools.results.stamp taken when the command started."""
    details = [f"- workload: the tests' 30-step SFT model on the addition task, `{recipe}`, 16 prompts x 8 samples x "
               f"<= 64 tokens, dynamic sampling off, medians of steps 2-{steps}; runs under `{shown(out)}`"]
    body = table(rows) + (f"\n\n{baseline}" if baseline else "")
    return write_result("scaling", "Scaling: results", body, origin, note=NOTE, details=details, path=path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="1+1,2+1,1+2,2+2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recipe", default="configs/tiny_fp8_e2e.yaml")
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "scaling")
    p.add_argument("overrides", nargs="*")
    add_results_doc_args(p, "scaling")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    layouts = []
    for item in a.layouts.split(","):
        try:
            n, m = (int(x) for x in item.split("+"))
        except ValueError:
            p.error(f"--layouts: {item!r} is not N+M (engines+trainers)")
        if n < 1 or m < 1:
            p.error(f"--layouts: {item!r} needs at least one engine and one trainer")
        layouts.append((n, m))
    if a.baseline_tree is not None and not (a.baseline_tree / "flows" / "grpo.py").is_file():
        p.error(f"--baseline-tree: {a.baseline_tree} is not a checkout of this project (no flows/grpo.py)")
    import process.quiet  # noqa: F401  third-party start-up noise off before transformers loads
    origin = stamp("bench.scaling", argv)  # the code that runs, before the measurement
    from embedded.bootstrap import default_sft, ensure_default_assets

    # the tests' ops assets (reused when complete; the ops tests' bootstrap.sft_steps=30)
    assets = ensure_default_assets(ASSETS, task="addition", sft=default_sft("addition", seed=0, steps=30))
    model, data = Path(assets["model_dir"]), Path(assets["train"]).parent
    a.out = a.out.resolve()  # the baseline tree's runs start in that tree: a relative --out would land there
    a.out.mkdir(parents=True, exist_ok=True)
    ov = [*base_overrides(model, data, a.steps), *a.overrides]
    rows = []
    for n, m in layouts:
        try:
            rows.append(run_layout(ROOT, a.recipe, ov, n, m, f"{n}+{m}", a.out))
        except RuntimeError as e:  # one failed layout does not lose the others
            print(f"layout {n}+{m} failed: {e}", flush=True)
            rows.append({"layout": f"{n}+{m}", "failed": str(e).splitlines()[0][:200]})
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    line = None
    if a.baseline_tree is not None:
        runs = []  # (is_head, step_s) in run order
        for i in range(a.repeats):
            for kind in pair_order(i):
                tree = ROOT if kind == "head" else a.baseline_tree.resolve()
                r = run_layout(tree, a.recipe, ov, 1, 1, f"{kind}-{i}", a.out)
                runs.append((kind == "head", r["time/step_s"]))
                print(json.dumps({"repeat": i, "tree": kind, "step_s": r["time/step_s"]}), flush=True)
        head = [v for h, v in runs if h]
        base = [v for h, v in runs if not h]
        ratio = statistics.median(head) / statistics.median(base)
        line = (f"1+1 step time, this tree / baseline ({a.baseline_tree}): {ratio:.3f} (medians over {a.repeats} "
                f"ABBA pairs, run order {[('H' if h else 'B') + format(v, '.2f') for h, v in runs]})")
        if len(runs) >= 4:
            est, lo, hi = drift_corrected_ratio(runs)
            line += f"; drift-corrected {est:.3f} [{lo:.3f}, {hi:.3f}] (95%)"
        print(line)
    doc = results_doc(a)
    if doc is not None and (line or any(not r.get("failed") for r in rows)):
        doc = write_results_doc(rows, line, origin, recipe=a.recipe, steps=a.steps, out=a.out, path=doc)
        print(f"scaling: results written to {doc}")
    return 0


def pair_order(i: int) -> tuple[str, str]:
    """Pair ``i`` of the baseline comparison: baseline first in even pairs, head first in odd ones (ABBA)."""
    return ("baseline", "head") if i % 2 == 0 else ("head", "baseline")


def drift_corrected_ratio(runs: list[tuple[bool, float]]) -> tuple[float, float, float]:
    """Head / baseline step-time ratio from runs in order (``(is_head, step_s)``): least squares of log(step_s) on
    an intercept, the run index (a linear drift of the machine) and a head indicator; the ratio is exp of the head
    coefficient, with a 95% t interval. Needs both trees and at least 4 runs."""
    import numpy as np
    from scipy.stats import t as student_t

    is_head = np.array([float(h) for h, _ in runs])
    if len(runs) < 4 or is_head.min() == is_head.max():
        raise ValueError("drift_corrected_ratio needs >= 4 runs of both trees")
    y = np.log(np.array([v for _, v in runs], dtype=float))
    x = np.c_[np.ones(len(runs)), np.arange(len(runs), dtype=float), is_head]
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    dof = len(runs) - 3
    se = float(np.sqrt((resid @ resid) / dof * np.linalg.inv(x.T @ x)[2, 2]))
    q = float(student_t.ppf(0.975, dof))
    return float(np.exp(beta[2])), float(np.exp(beta[2] - q * se)), float(np.exp(beta[2] + q * se))


if __name__ == "__main__":
    sys.exit(main())
