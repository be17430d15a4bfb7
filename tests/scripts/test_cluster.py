"""A real multi-node path on one machine: ``scripts/cluster`` starts a Ray head and a worker node as
separate ``ray start`` processes with token authentication; ``python -m flows.grpo`` connects with ``ray.address``
and ``ray.auth_token_path`` and runs 2 rollout engines + 2 data-parallel trainers spread over the two nodes (the
head has room for one engine + one trainer), writes a checkpoint and MLflow metrics. A resume of 2 trainers'
checkpoint on 1 (2 -> 1) runs through the same command in tests/ops/test_faults.py (after a trainer rank was killed),
a 2 -> 2 one in tests/trainer/test_dp_policy.py. ``scripts/cluster stop`` leaves none of the cluster's processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _ops import ROOT, TINY, run_logged  # noqa: E402
from _runs import check_refits_and_mismatch  # noqa: E402

CLUSTER = [sys.executable, str(ROOT / "scripts" / "cluster.py")]


def _cluster_pids(d) -> list[int]:
    # scripts/cluster.py by its path: the name "cluster" is the project's cluster/ package
    import importlib.util

    spec = importlib.util.spec_from_file_location("scripts_cluster", ROOT / "scripts" / "cluster.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.MARK == "FP8_GRPO_CLUSTER"
    return script._marked(str(d))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_nodes_two_engines_two_trainers_write_a_checkpoint(tmp_path):
    from mlflow.tracking import MlflowClient

    d = tmp_path / "cluster"
    t0 = time.monotonic()
    r = subprocess.run([*CLUSTER, "start", "--dir", str(d), "--workers", "1", "--head-cpus", "1",
                        "--worker-cpus", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    try:
        assert r.returncode == 0, r.stdout + r.stderr + (d / "cluster.log").read_text()[-3000:]
        print(f"\n[cluster up in {time.monotonic() - t0:.1f}s]\n{r.stdout}")
        state = json.loads((d / "cluster.json").read_text())
        token = d / "ray_auth_token"
        assert state["token_path"] == str(token) and token.stat().st_mode & 0o777 == 0o600
        assert token.read_text() not in r.stdout + r.stderr
        # the driver knows the cluster only from the config: no RAY_AUTH_* / RAY_ADDRESS of its own
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
        db = f"sqlite:///{tmp_path / 'mlflow.db'}"
        base = ["configs/tiny_fp8_e2e.yaml", *TINY, f"run_dir={tmp_path / 'run'}", f"logger.mlflow.tracking_uri={db}",
                f"ray.address={state['address']}", f"ray.auth_token_path={token}", "cluster.rollout_workers=2",
                "cluster.placement_strategy=SPREAD", "grpo.val_at_start=false", "cluster.policy_workers=2",
                "ray.policy_worker.num_cpus=0.5"]
        r1 = run_logged([sys.executable, "-m", "flows.grpo", *base, "grpo.max_num_steps=1"], env=env, timeout=1200)
        assert r1.returncode == 0, r1.stdout[-3000:] + r1.stderr[-3000:]
        assert "rollout 2 x vLLM" in r1.stdout and "on 2 Ray node(s)" in r1.stdout, r1.stdout[-3000:]
        assert "x 2 trainer(s)" in r1.stdout, r1.stdout[-3000:]
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert (summary["first_step"], summary["last_step"]) == (1, 1) and summary["checkpoint"].endswith("step_000001")

        c = MlflowClient(tracking_uri=db)
        run = c.get_run(summary["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.data.tags["cluster/nodes"] == "2"
        for key in ("reward/mean", "rollout/engines", "mismatch/token_mult_prob_error"):
            assert sorted(m.step for m in c.get_metric_history(run.info.run_id, key)) == [1], key
        assert {m.value for m in c.get_metric_history(run.info.run_id, "rollout/engines")} == {2.0}
        check_refits_and_mismatch(c, run.info.run_id)  # both engines, on the two nodes, on the refit's weights
    finally:
        s = subprocess.run([*CLUSTER, "stop", "--dir", str(d)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        print(s.stdout + s.stderr)
    assert s.returncode == 0 and not _cluster_pids(d), s.stdout
