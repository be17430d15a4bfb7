"""Screenshots of what a user browses after a run: the MLflow run page (its description's report and charts) and
the Prefect flow run with its report artifact, taken by headless Chromium from a real local stack.

    .venv/bin/python scripts/screenshots.py [--out runs/screenshots] [--steps 2] [key=value ...]

Starts the local stack (scripts/stack: Prefect server, worker, deployments, MLflow server) on free loopback ports,
runs the ``fp8-grpo/fp8-grpo`` deployment on the tiny end-to-end FP8 recipe (``--steps`` steps, the overrides after
it), finds the flow run, its artifact and the MLflow run through their APIs, and writes ``mlflow-run.png``,
``mlflow-charts.png``, ``prefect-flow-run.png``, ``prefect-artifact.png`` and the second step's subflow
``prefect-rl-step-2.png`` (its tasks on a timeline) under ``--out``; then stops the stack.
Needs a Chromium binary (Debian: ``apt-get install chromium``; ``--chromium PATH`` or $CHROMIUM otherwise)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TINY = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=4",
        "policy.train_micro_batch_size=4", "grpo.max_val_samples=16", "grpo.val_period=1",
        "policy.generation.max_new_tokens=32", "evaluation.sets=[]", "evaluation.num_samples=0",
        "checkpointing.save_period=1"]


def rest(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def shoot(chromium: str, url: str, path: Path, *, height: int = 1100) -> Path:
    """One page as a PNG: headless Chromium with time for the single-page app to load its data."""
    subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1600,{height}", "--virtual-time-budget=20000", f"--screenshot={path}", url],
                   check=True, capture_output=True, timeout=120)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/screenshots.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "screenshots")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chromium", default=os.environ.get("CHROMIUM") or shutil.which("chromium")
                   or shutil.which("chromium-browser"))
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    a = p.parse_args(argv)
    if not a.chromium:
        p.error("--chromium: no Chromium found (apt-get install chromium, or pass its path)")
    out = a.out.resolve()
    stack_dir = out / "stack"
    out.mkdir(parents=True, exist_ok=True)
    stack = [PY, str(ROOT / "scripts" / "stack.py")]
    subprocess.run([*stack, "start", "--run-dir", str(stack_dir), "--prefect-port", "0", "--mlflow-port", "0"],
                   check=True, cwd=ROOT)
    try:
        state = json.loads((stack_dir / "stack.json").read_text())
        env = dict(os.environ)
        for line in subprocess.run([*stack, "env", "--run-dir", str(stack_dir)], capture_output=True, text=True,
                                   check=True, cwd=ROOT).stdout.splitlines():
            key, value = line[len("export "):].split("=", 1)
            if key != "PATH":
                env[key] = value.strip("'")
        name = f"screenshots-{os.getpid()}"
        params = {"config_path": "configs/tiny_fp8_e2e.yaml",
                  "overrides": [*TINY, f"grpo.max_num_steps={a.steps}", f"run_dir={out / 'run'}",
                                f"logger.mlflow.run_name={name}", *a.overrides]}
        subprocess.run([str(Path(PY).with_name("prefect")), "deployment", "run", "fp8-grpo/fp8-grpo", "--params",
                        json.dumps(params), "--flow-run-name", name, "--watch", "--watch-timeout", "900"],
                       check=True, env=env, cwd=ROOT)
        api, ui, mlflow = state["prefect_api_url"], state["prefect_ui_url"], state["mlflow_url"]
        flow_run = rest(f"{api}/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})[0]
        artifact = rest(f"{api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})[0]
        exp = rest(f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?experiment_name=fp8-grpo")["experiment"]
        runs = rest(f"{mlflow}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]],
                                                           "filter": f"attributes.run_name = '{name}'"})["runs"]
        run_id = runs[0]["info"]["run_id"]
        # the second step's subflow: its tasks on a timeline (asynchronous: rollout-step-3 beside train)
        steps = sorted(rest(f"{api}/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"operator": "and_",
                                                                                            "any_": [flow_run["id"]]}},
                                                        "flows": {"name": {"any_": ["rl_step"]}}}),
                       key=lambda r: r["start_time"] or "")
        shots = [shoot(a.chromium, f"{mlflow}/#/experiments/{exp['experiment_id']}/runs/{run_id}",
                       out / "mlflow-run.png", height=1400),
                 shoot(a.chromium, f"{mlflow}/#/experiments/{exp['experiment_id']}/runs/{run_id}/artifacts/"
                       + urllib.parse.quote("curves.png"), out / "mlflow-charts.png", height=1200),
                 shoot(a.chromium, f"{ui}/runs/flow-run/{flow_run['id']}", out / "prefect-flow-run.png"),
                 shoot(a.chromium, f"{ui}/artifacts/artifact/{artifact['id']}", out / "prefect-artifact.png")]
        if len(steps) > 1:
            shots.append(shoot(a.chromium, f"{ui}/runs/flow-run/{steps[1]['id']}", out / "prefect-rl-step-2.png"))
        for s in shots:
            print(f"screenshot: {s}")
    finally:
        subprocess.run([*stack, "stop", "--run-dir", str(stack_dir)], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
