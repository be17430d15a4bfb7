"""Rollout fan-out end to end: ``cluster.rollout_workers=2`` runs two vLLM engines in the run's
placement group; every step refits both from one object in Ray's object store, splits the prompt groups over them,
and trains on the gathered rollouts; validation fans out too. On the 2-core test machine this is a correctness run
(1-2 tiny steps), not a speed measurement."""

from __future__ import annotations

import pytest
from _ops import TINY


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_rollout_engines_two_steps(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from flows.grpo import grpo

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    s = grpo("configs/tiny_fp8_e2e.yaml", [*TINY, f"run_dir={tmp_path / 'run'}", f"logger.mlflow.tracking_uri={db}",
                                           "checkpointing.enabled=false", "cluster.rollout_workers=2",
                                           "cluster.placement_strategy=STRICT_PACK"])
    out = capsys.readouterr().out
    assert "rollout 2 x vLLM" in out and "step   2/2 | reward" in out, out[-3000:]
    assert s["steps_run"] == 2 and 1.0 <= s["mean_token_mult_prob_error"] < 2.0
    c = MlflowClient(tracking_uri=db)
    run = c.get_run(s["mlflow_run_id"])
    assert run.data.params["cluster.rollout_workers"] == "2" and run.info.status == "FINISHED"

    def hist(key):
        return [m.value for m in sorted(c.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    assert hist("rollout/engines") == [2.0, 2.0]  # 2 prompts per step: one whole group per engine
    assert hist("refit/weights_version") == [0.0, 1.0]  # both engines loaded the policy of the step before
    assert min(hist("time/rollout_engine_min_s")) > 0  # both engines generated
    assert len(hist("val/accuracy")) == 1 and hist("rollout/generated_tokens")[0] > 0
