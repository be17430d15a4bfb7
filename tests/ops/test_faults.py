"""Worker faults, through ``python -m flows.grpo`` with real Ray actors, vLLM engines and MLflow, in one run with
two data-parallel trainer ranks and both faults (3 runs in all: a reference, the faulty run, its resume):

- a rollout engine SIGKILLed mid-rollout (step 2): Ray restarts it, the step waits and redoes refit + rollout, and
  every step's metrics are logged once and equal those of the same run without the fault (same seeds, so the same
  samples: nothing lost or duplicated), down to the step's checkpoint weights;
- a trainer rank SIGKILLed mid-step (step 3): the run stops within a minute (not after the collective's timeout)
  with an error that names the worker, the last complete checkpoint and ``checkpointing.resume=true``, nothing it
  started stays up, and the resumed run finishes in the same MLflow run -- on one trainer: the 2 ranks' checkpoint
  resumes with any number of ranks (2 -> 1 here, 2 -> 2 in tests/trainer/test_dp_policy.py).

The kills are the TEST-ONLY ``testing.fault_kill_*_at_step`` knobs: the worker SIGKILLs its own process at a known
point (process/faults.py), once per run dir."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

import pytest
from _ops import TINY, kill_marked, processes_with_env, run_logged, wait_for
from _runs import check_refits_and_mismatch

from storage.checkpoint import CheckpointStore

MARK = "FP8_GRPO_OPS_MARK"
# 3 steps (engine killed at 2, a trainer at 3), every group trains, two ranks, a checkpoint every step
STEPS = ["grpo.max_num_steps=3", "grpo.dynamic_sampling=false", "cluster.policy_workers=2",
         "checkpointing.save_period=1"]


def _env(mark: str) -> dict:
    env = dict(os.environ)
    env[MARK] = mark
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def _run(tmp_path, name: str, *extra: str, timeout: float = 600):
    run_dir, mark = tmp_path / name, uuid.uuid4().hex
    uri = f"sqlite:///{tmp_path / f'{name}.db'}"
    args = ["configs/tiny_fp8_e2e.yaml", *TINY, *STEPS, f"run_dir={run_dir}", f"logger.mlflow.tracking_uri={uri}",
            "checkpointing.keep_last_k=5", *extra]
    r = run_logged([sys.executable, "-m", "flows.grpo", *args], env=_env(mark), timeout=timeout)
    kill_marked(MARK, mark)
    return r, run_dir, uri, args, mark


@pytest.mark.e2e
@pytest.mark.slow
def test_engine_killed_step_is_redone_then_trainer_killed_stops_fast_and_resumes(tmp_path):
    import torch
    from mlflow.tracking import MlflowClient

    ref, ref_dir, ref_uri, _, _ = _run(tmp_path, "reference", "grpo.max_num_steps=2")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    t0 = time.time()
    r, run_dir, uri, args, mark = _run(tmp_path, "faulty", "testing.fault_kill_rollout_at_step=2",
                                       "testing.fault_kill_policy_at_step=3")
    t_exit = time.time()
    out = r.stdout + r.stderr

    # the engine killed at step 2: the step is redone, and the run goes on
    assert "TEST-ONLY FAULT: testing.fault_kill_rollout_at_step=2" in r.stdout
    assert (run_dir / "faults" / "kill_rollout_step_000002").exists()
    lines = [ln for ln in r.stdout.splitlines() if "rollout engine(s)" in ln]  # (Ray's raylet also says "died")
    assert len(lines) == 1 and lines[0].startswith("step 2: rollout engine(s) fp8grpo-rollout-"), lines
    assert "redoing refit + rollout (retry 1)" in lines[0]

    # the trainer killed at step 3: the run is over (workers ended, MLflow closed) well within a minute
    assert r.returncode != 0, out[-3000:]
    marker = run_dir / "faults" / "kill_policy_step_000003"
    assert marker.exists(), out[-3000:]
    stop_s = t_exit - marker.stat().st_mtime  # armed just before the step's update
    print(f"[trainer killed -> run exited in {stop_s:.1f}s; whole run {t_exit - t0:.0f}s]")
    assert stop_s < 60, stop_s
    assert "policy worker(s) fp8grpo-policy-" in out and "died during step 3" in out, out[-3000:]
    ck = run_dir / "checkpoints"
    assert f"the last complete checkpoint is step 2 under {ck}" in out, out[-3000:]
    assert "checkpointing.resume=true" in out
    wait_for(lambda: not processes_with_env(MARK, mark), 30, "every process of the failed run ended")
    run_id = CheckpointStore(str(ck)).load_state(2)["mlflow_run_id"]
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FAILED"

    # steps 1-2 logged once each and the same numbers as without the fault: the redone rollout sampled the same
    # tokens; the step-2 checkpoints hold the same masters
    ref_id = json.loads((ref_dir / "summary.json").read_text())["mlflow_run_id"]
    for key in ("reward/mean", "rollout/generated_tokens", "mismatch/token_mult_prob_error", "loss/pg",
                "train/grad_norm"):
        got, want = _history(uri, run_id, key), _history(ref_uri, ref_id, key)
        assert [s for s, _ in got] == [1, 2], (key, got)
        assert got == want, (key, got, want)
    # the refit group formed at step 1 and again when step 2 was redone (the restarted engine was in none)
    assert [v for _, v in _history(uri, run_id, "refit/group_generation")] == [1.0, 2.0]
    assert [v for _, v in _history(ref_uri, ref_id, "refit/group_generation")] == [1.0, 1.0]
    a, b = CheckpointStore(str(ck)), CheckpointStore(str(ref_dir / "checkpoints"))
    wa, wb = a.load(2).weights, b.load(2).weights
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "step-2 masters differ"

    # resumed on one trainer: the same MLflow run finishes step 3
    r2 = run_logged([sys.executable, "-m", "flows.grpo", *args, "checkpointing.resume=true",
                     "cluster.policy_workers=1"], env=_env(mark), timeout=600)
    kill_marked(MARK, mark)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert f"resume: checkpoint {CheckpointStore(str(ck)).step_uri(2)} (step 2)" in r2.stdout
    assert "x 1 trainer(s)" in r2.stdout, r2.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"], summary["mlflow_run_id"]) == (3, 3, run_id)
    for key in ("reward/mean", "time/step_s"):
        assert [s for s, _ in _history(uri, run_id, key)] == [1, 2, 3], key
    assert [v for _, v in _history(uri, run_id, "fault/rollout_retries")] == [0.0, 1.0, 0.0]
    assert CheckpointStore(str(ck)).latest_step() == 3
    # the redone step 2 ran on the restarted engine's refit of the step-1 policy, step 3 on the resumed one's
    check_refits_and_mismatch(MlflowClient(tracking_uri=uri), run_id)


def test_fault_markers_claim_once(tmp_path):
    from process.faults import claim_once

    assert claim_once(tmp_path, "kill_rollout", 2)
    assert not claim_once(tmp_path, "kill_rollout", 2)
    assert claim_once(tmp_path, "kill_rollout", 3) and claim_once(tmp_path, "kill_policy", 2)
    assert not claim_once(tmp_path, "kill_policy", 2)


def test_no_fault_is_due_when_the_knobs_are_off(tmp_path):
    """Knobs at 0 (every real run) never fire, also not at the step-0 rollout of the initial KV calibration (a bug
    that once SIGKILLed the engine of every FP8-KV run); a set knob fires once, at its step."""
    from configs.schema import Config
    from process.faults import TestHooks
    from tasks.rl import _fault_due

    class Ctx:
        hooks = TestHooks(kill_rollout_at_step=0, kill_policy_at_step=2, marker_dir=str(tmp_path))

    assert not any(_fault_due(Ctx, "kill_rollout", s) for s in (0, 1, 2))
    assert [s for s in (0, 1, 2, 2, 3) if _fault_due(Ctx, "kill_policy", s)] == [2]
    assert TestHooks.from_config(Config(), tmp_path) is None  # every knob off: a real run carries no hooks at all
