"""The run's report (the Prefect artifact): what a user asks first -- accuracy start -> end with CIs, mismatch, step
time, where the MLflow run is -- from the summary and validation metrics the flow keeps."""
from configs.schema import load_config
from flows.run_report import run_report


def test_report_answers_accuracy_mismatch_and_time():
    cfg = load_config("configs/tiny_fp8_e2e.yaml", ["grpo.async_grpo.enabled=true", "grpo.max_num_steps=15"])
    summary = {"precision": "fp8-e2e", "cpu_kind": "amx", "cpu_rollout_kind": "amx", "first_step": 1, "last_step": 15,
               "steps_run": 15, "mean_token_mult_prob_error": 1.00213, "mean_step_s": 3.1, "step_interval_s": 3.4,
               "mean_time_split_s": {"refit": 0.1, "rollout": 1.0, "train": 2.0, "calibrate": None},
               "mlflow_ui_url": "http://127.0.0.1:5000/#/experiments/1/runs/abc", "checkpoint": "runs/x/step_000015"}
    val = {0: {"val/accuracy": 0.32, "val/accuracy_lo": 0.281, "val/accuracy_hi": 0.362},
           15: {"val/accuracy": 0.938, "val/accuracy_lo": 0.913, "val/accuracy_hi": 0.956}}
    text = run_report(cfg, summary, val)
    assert "| validation accuracy (greedy, 95% CI) | 0.320 [0.281, 0.362] (step 0) -> 0.938 [0.913, 0.956] (step 15) |" in text
    assert "| mean token-mult-prob-error | 1.0021 |" in text
    assert "| mean step / step interval (s) | 3.10 / 3.40 |" in text
    assert "refit 0.10, rollout 1.00, train 2.00 |" in text and "calibrate" not in text
    assert "asynchronous (max trajectory age 1)" in text and "| CPU kind | amx (rollout amx) |" in text
    assert "| MLflow | http://127.0.0.1:5000/#/experiments/1/runs/abc |" in text
    # a run that stopped before any validation still gets a report
    assert "| validation accuracy (greedy, 95% CI) | - |" in run_report(cfg, {**summary, "mlflow_ui_url": None}, {})
