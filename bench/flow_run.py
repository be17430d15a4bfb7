"""The orchestration rows of the bench: a short run of the real flow (``python -m flows.grpo``: Prefect flow and
subflows, Ray actors, MLflow on sqlite) on the bench workload, read back from its MLflow metrics.

* orchestration share = ``time/share_orchestration`` (flows/rl_step.py: the step's wall time not spent in the
  workers' own work -- Prefect task/subflow overhead, Ray calls, MLflow logging in the tasks), median of steps 2..N;
* refit + KV calibration share = ``time/share_refit_kv``, median of steps 2..N;
* time to first step = wall time from the flow process's start to the end of step 1 minus step 1's own time (imports,
  Prefect's temporary server, Ray, workers up, first refit), and the flow's own "workers up in" figure.

    .venv/bin/python -m bench.flow_run configs/tiny_fp8_e2e.yaml --steps 4     # prints JSON
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.step import recipe_overrides
from bench.workload import ROOT, Workload, default_workload


def flow_overrides(w: Workload, run_dir: Path, steps: int, uri: str) -> list[str]:
    val = str(Path(w.train_path).with_name("validation.jsonl"))
    return [*recipe_overrides(w), f"policy.model_name={w.model_dir}", "data.task=arithmetic",
            f"data.train_path={w.train_path}", f"data.validation_path={val}", f"grpo.max_num_steps={steps}",
            "grpo.val_at_start=false", "grpo.val_period=0", "grpo.max_val_samples=16", "evaluation.num_samples=0",
            "evaluation.sets=[]", "checkpointing.enabled=false", f"run_dir={run_dir}",
            f"logger.mlflow.tracking_uri={uri}"]


def run_flow(recipe: str, w: Workload, *, steps: int = 4, overrides: tuple[str, ...] = (), label: str = "") -> dict:
    """Run the flow on ``recipe`` + the bench workload (+ ``overrides``) in a subprocess; the figures above, the
    summary's ``step_interval_s`` / ``mean_step_s`` and the MLflow run id. ``label`` names the run dir."""
    from mlflow.tracking import MlflowClient

    name = Path(recipe).stem + (f"-{label}" if label else "")
    run_dir = ROOT / "runs" / "bench" / f"flow-{name}"
    uri = f"sqlite:///{ROOT / 'runs' / 'bench' / 'flow-mlflow.db'}"
    cmd = [sys.executable, "-m", "flows.grpo", str(ROOT / recipe), *flow_overrides(w, run_dir, steps, uri),
           *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # loaded machines
                                 **os.environ, "PYTHONPATH": str(ROOT)})
    first_step_at, workers_up, tail = None, None, []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if first_step_at is None and re.match(r"step\s+1/\d+ \| reward", line):
            first_step_at = time.perf_counter() - t0
        m = re.search(r"workers up in ([0-9.]+)s", line)
        if m:
            workers_up = float(m.group(1))
    if proc.wait() != 0:
        raise RuntimeError(f"bench flow run failed (rc {proc.returncode}): {' '.join(cmd)}\n{''.join(tail)}")
    summary = json.loads((run_dir / "summary.json").read_text())
    c = MlflowClient(tracking_uri=summary["mlflow_tracking_uri"])

    def series(key: str) -> list[float]:
        hist = sorted(c.get_metric_history(summary["mlflow_run_id"], key), key=lambda m: m.step)
        return [m.value for m in hist]

    def median_tail(key: str) -> float | None:
        vals = series(key)[1:] or series(key)
        return statistics.median(vals) if vals else None

    step1 = (series("time/step_s") or [0.0])[0]
    return {"recipe": recipe, "steps": steps, "wall_s": time.perf_counter() - t0,
            "share_orchestration": median_tail("time/share_orchestration"),
            "orchestration_s": median_tail("time/orchestration_s"),
            "share_refit_kv": median_tail("time/share_refit_kv"), "step_s": median_tail("time/step_s"),
            "workers_up_s": workers_up,
            "time_to_first_step_s": None if first_step_at is None else first_step_at - step1,
            "step_interval_s": summary.get("step_interval_s"), "mean_step_s": summary.get("mean_step_s"),
            # asynchronous: the share of each train task with a rollout in flight, median over the steps that
            # generated one ahead (all but the last)
            "train_overlap_frac": statistics.median(series("async/train_overlap_frac")[:-1] or [0.0]),
            "rollout_hidden_frac": statistics.median(series("async/rollout_hidden_frac")[:-1] or [0.0]),
            "mlflow_run_id": summary["mlflow_run_id"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick-model", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(run_flow(args.recipe, default_workload(quick=args.quick_model), steps=args.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
