"""Asynchronous GRPO through ``python -m flows.grpo`` with real Ray actors, vLLM engines and MLflow: a run whose
rollout engine is SIGKILLed while it generates a step ahead and whose trainer is SIGKILLed in the last step, then its
resume -- every step trained once on a trajectory of the age the schedule promises, each step once in MLflow.

Run 1 (4 steps, checkpoint every 2): step 1 generates its own rollout (age 0) and step 2's ahead; step 2 trains on it
(age 1) while the engine generating step 3 ahead is killed (Ray restarts it; the rollout is dropped); step 3
generates its own (age 0) and step 4's; the trainer dies in step 4. Run 2 resumes from the step-2 checkpoint in the
same MLflow run: step 3 again (logged by run 1: kept once), step 4."""

from __future__ import annotations

import os
import sys
import uuid

import pytest
from _ops import TINY, kill_marked, processes_with_env, run_logged, wait_for
from _runs import check_refits_and_mismatch

from storage.checkpoint import CheckpointStore

MARK = "FP8_GRPO_OPS_MARK"


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


@pytest.mark.e2e
@pytest.mark.slow
def test_async_run_survives_a_killed_engine_and_a_resume_with_each_step_once(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir, mark = tmp_path / "run", uuid.uuid4().hex
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, MARK: mark, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    args = ["configs/tiny_fp8_e2e.yaml", *TINY, "grpo.max_num_steps=4", "grpo.dynamic_sampling=false",
            "grpo.async_grpo.enabled=true", "checkpointing.save_period=2", "checkpointing.keep_last_k=5",
            f"run_dir={run_dir}", f"logger.mlflow.tracking_uri={uri}"]
    r = run_logged([sys.executable, "-m", "flows.grpo", *args, "testing.fault_kill_rollout_at_step=3",
                    "testing.fault_kill_policy_at_step=4"], env=env, timeout=600)
    kill_marked(MARK, mark)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if "rollout engine(s)" in ln]
    assert len(lines) == 1 and lines[0].startswith("step 2: rollout engine(s) fp8grpo-rollout-"), lines
    assert "died generating step 3 ahead" in lines[0] and "step 3 generates it again" in lines[0]
    assert "died during step 4" in out and "the last complete checkpoint is step 2" in out, out[-3000:]
    wait_for(lambda: not processes_with_env(MARK, mark), 30, "every process of the failed run ended")
    ck = run_dir / "checkpoints"
    run_id = CheckpointStore(str(ck)).load_state(2)["mlflow_run_id"]
    assert [s for s, _ in _history(uri, run_id, "reward/mean")] == [1, 2, 3]
    first_step3 = dict(_history(uri, run_id, "reward/mean"))[3]

    r2 = run_logged([sys.executable, "-m", "flows.grpo", *args, "checkpointing.resume=true"], env=env, timeout=600)
    kill_marked(MARK, mark)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert "(step 2)" in r2.stdout and "resume: steps 3-3 were logged by the stopped run" in r2.stdout, r2.stdout
    wait_for(lambda: not processes_with_env(MARK, mark), 30, "every process of the resumed run ended")
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FINISHED"
    for key in ("reward/mean", "time/step_s", "loss/pg", "refit/weights_version"):
        assert [s for s, _ in _history(uri, run_id, key)] == [1, 2, 3, 4], key  # each step once
    assert dict(_history(uri, run_id, "reward/mean"))[3] == first_step3  # the replayed step keeps its first values
    # the age of each step's trajectories: generated now (0) or one step ahead (1); run 1's step 3 was regenerated
    # after the engine died, run 2's step 3 is a resume's first step
    assert [v for _, v in _history(uri, run_id, "async/trajectory_age_max")] == [0.0, 1.0, 0.0, 1.0]
    assert [v for _, v in _history(uri, run_id, "fault/rollout_retries")] == [0.0, 1.0, 0.0, 0.0]
    overlap = dict(_history(uri, run_id, "async/rollout_hidden_frac"))
    assert overlap[1] > 0.0 and overlap[3] > 0.0  # rollouts ahead ran while those steps trained
    assert CheckpointStore(str(ck)).latest_step() == 4
    # what the engines generated each step with: the policy of step t - 1 - age (also after the restart and resume)
    check_refits_and_mismatch(MlflowClient(tracking_uri=uri), run_id, ages={1: 0, 2: 1, 3: 0, 4: 1})
