"""End to end on Mixture-of-Experts: the tiny Qwen3-MoE end-to-end FP8 recipe with routing replay runs 2
RL steps through the real pipeline -- Prefect flow, Ray actors (PolicyWorker: FP8 experts + FP32 router, replaying
the engine's experts; RolloutWorker: vLLM with our FP8 MoE method, returning each token's experts), MLflow on
sqlite, a local checkpoint -- and logs the moe/* metrics every step."""
from pathlib import Path

import pytest
from _runs import check_refits_and_mismatch

ROOT = Path(__file__).resolve().parents[2]
MOE_METRICS = ["moe/routing_mismatch_frac", "moe/expert_load_max", "moe/expert_load_min", "moe/expert_load_cv",
               "moe/router_replay", "mismatch/token_mult_prob_error", "loss/pg", "train/grad_norm",
               "time/rollout_routing_s", "val/accuracy"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_moe_fp8_two_steps_with_routing_replay(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from flows.grpo import grpo

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    over = [f"run_dir={tmp_path / 'run'}", f"logger.mlflow.tracking_uri={db}", "grpo.max_num_steps=2",
            "grpo.val_period=1", "grpo.max_val_samples=8", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8", "checkpointing.save_period=2", "evaluation.sets=[]",
            "evaluation.num_samples=0", "policy.router_replay.enabled=true",
            f"bootstrap.assets_dir={ROOT / 'runs' / 'test-env' / 'ops-assets'}", "bootstrap.sft_steps=30",
            "grpo.dynamic_sampling=false"]  # keep every group: this test is about the pipeline
    s = grpo(str(ROOT / "configs" / "tiny_moe_fp8_e2e.yaml"), over)
    out = capsys.readouterr().out
    assert "step   2/2 | reward" in out
    assert s["steps_run"] == 2 and 1.0 <= s["mean_token_mult_prob_error"] < 2.0
    run = MlflowClient(tracking_uri=db).get_run(s["mlflow_run_id"])
    missing = [k for k in MOE_METRICS if k not in run.data.metrics]
    assert not missing, missing
    met = run.data.metrics
    assert met["moe/router_replay"] == 1.0 and 0.0 <= met["moe/routing_mismatch_frac"] < 0.5
    assert met["moe/expert_load_max"] >= 1.0 >= met["moe/expert_load_min"]
    assert run.data.tags["recipe"] == "tiny_moe_fp8_e2e" and run.data.tags["precision"] == "fp8-e2e"
    assert run.data.params["bootstrap.model"] == "moe"
    assert run.info.status == "FINISHED"
    check_refits_and_mismatch(MlflowClient(tracking_uri=db), s["mlflow_run_id"])
