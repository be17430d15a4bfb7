"""What a user sees: a real ``python -m flows.grpo`` start from cold assets (tokenizer, tiny model and SFT built on
the way) prints our progress lines -- validation with 95% CIs per set, pass@k, the step lines, an MLflow link that
opens the model-training view -- and none of the third-party start-up noise (torchao .so load failures, torch pytree
deprecation warnings, HF "Loading weights" bars, MLflow's database-creation INFO lines). Per-prompt validation
files land under run_dir/val/<set>/ and summary.json names them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = ["Failed to load", "_C_mxfp8", "register_constant()", "Loading weights", "Creating initial MLflow database",
         "Generating train split", "it/s]"]


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                                                             "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    return env


@pytest.mark.slow
def test_the_noise_exists_without_the_filters(tmp_path):
    """The check below can fail: loading a model in a fresh process without process.quiet prints the noise."""
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "m", TinyModelSpec())
    code = ("from transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(model)!r})\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "Loading weights" in text and "Failed to load" in text and "register_constant()" in text
    quiet = subprocess.run([sys.executable, "-c", "import process.quiet\n" + code], cwd=ROOT, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and not [n for n in NOISE if n in quiet.stdout + quiet.stderr], quiet.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cli_start_shows_our_lines_without_third_party_noise(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "flows.grpo", "configs/tiny_bf16.yaml", f"run_dir={run_dir}",
            f"bootstrap.assets_dir={tmp_path / 'assets'}", "bootstrap.sft_steps=5", "checkpointing.enabled=false",
            "grpo.max_num_steps=1", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "grpo.max_val_samples=12"]
    out = subprocess.run(args, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=1400)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    noise = [n for n in NOISE if n in text]
    assert not noise, f"third-party noise {noise} in:\n{text[-4000:]}"
    lines = out.stdout.splitlines()
    assert any(ln.startswith("step   0/1 | validation accuracy (greedy, 95% CI): main ") and "digits4 " in ln
               for ln in lines), out.stdout
    assert any("8 samples at T=1.0 on 12 prompts: pass@1 " in ln and "pass@8 " in ln and "avg@8 " in ln
               for ln in lines), out.stdout
    assert any(ln.startswith("step   1/1 | reward ") for ln in lines), out.stdout
    links = [ln for ln in lines if ln.startswith("MLflow charts: http://127.0.0.1:5000/#/experiments/")]
    assert links and "/model-metrics?workflowType=machine_learning" in links[0], out.stdout
    assert "mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///" in links[0]

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["mlflow_ui_url"] in links[0] and s["mlflow_run_id"] in s["mlflow_ui_url"]
    assert set(s["val_files"]) == {"main", "digits4"} and sorted(s["val_files"]["main"]) == ["0", "1"]
    rows = [json.loads(x) for x in Path(s["val_files"]["main"]["0"]).read_text().splitlines()]
    assert len(rows) == 12 and [r["id"] for r in rows] == list(range(12))
    assert all(len(r["samples_correct"]) == 8 for r in rows)  # sampled at start (evaluation.sampled_when: ends)
    assert 0 < s["validate_share"] < 1
    m = s["val_metrics"]["1"]
    assert m["val/accuracy"] == m["val/main/accuracy"] and m["val/main/accuracy_lo"] <= m["val/accuracy"]
    assert m["val/digits4/num_prompts"] == 12  # grpo.max_val_samples caps every set

    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=s["mlflow_tracking_uri"])
    run = c.get_run(s["mlflow_run_id"])
    assert c.get_experiment(run.info.experiment_id).tags.get("mlflow.experimentKind") == "custom_model_development"
    assert "val/digits4/accuracy_hi" in run.data.metrics and "val/main/pass_at_8" in run.data.metrics
    arts = {a.path for a in c.list_artifacts(run.info.run_id, "val/main")}
    assert "val/main/step_000001.jsonl" in arts
