"""The learning experiment (experiments/learning.py), shortened: one recipe x two seeds of one RL step each through
the real pipeline, as child MLflow runs of one parent; the paired, seed-stratified gain table from the runs'
per-prompt validation files; a rerun skips the finished runs and reuses the parent."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the 5-step warm start these shortened experiments share (built once, cached like runs/test-env/ops-assets)
SMALL_ASSETS = ROOT / "runs" / "test-env" / "small-assets"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_learning_two_seeds_table_and_resume(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from experiments.learning import learning

    recipe = str(ROOT / "configs" / "tiny_bf16.yaml")
    overrides = ["grpo.max_num_steps=1", "grpo.max_val_samples=8", "grpo.num_prompts_per_step=4",
                 "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
                 "policy.train_micro_batch_size=16", "evaluation.sets=[]", "evaluation.num_samples=0",
                 "checkpointing.enabled=false", f"bootstrap.assets_dir={SMALL_ASSETS}", "bootstrap.sft_steps=5"]
    out_dir = tmp_path / "learning"
    r1 = learning([recipe], [0, 1], overrides, str(out_dir), n_boot=500)
    out = capsys.readouterr().out
    assert "learning: training tiny_bf16-seed0" in out and "learning: training tiny_bf16-seed1" in out
    row = r1["rows"][0]
    assert [s["seed"] for s in row["per_seed"]] == [0, 1]
    assert all(s["val_prompts"] == 8 for s in row["per_seed"])
    g = row["gain"]
    assert g["lo"] <= g["value"] <= g["hi"] and g["n"] == 16  # 8 prompts x 2 seed strata
    per_seed = [s["gain"] for s in row["per_seed"]]
    assert g["value"] == pytest.approx(sum(per_seed) / 2)
    # each seed trained from its own warm start (grpo.seed -> tiny-qwen3-sft-seed<k>)
    assert {p.name for p in (SMALL_ASSETS / "addition").glob("tiny-qwen3-sft-seed*")} == \
        {"tiny-qwen3-sft-seed0", "tiny-qwen3-sft-seed1"}
    table = (out_dir / "learning.md").read_text()
    assert f"`{recipe}`" in table and "paired bootstrap" in table
    c = MlflowClient(tracking_uri=f"sqlite:///{out_dir / 'mlflow.db'}")
    parent = c.get_run(r1["parent_run_id"])
    assert parent.info.status == "FINISHED"
    children = c.search_runs([parent.info.experiment_id],
                             filter_string=f"tags.`mlflow.parentRunId` = '{r1['parent_run_id']}'")
    assert sorted(ch.data.tags["learning.seed"] for ch in children) == ["0", "1"]
    assert "learning.md" in {a.path for a in c.list_artifacts(r1["parent_run_id"])}

    r2 = learning([recipe], [0, 1], overrides, str(out_dir), n_boot=500)  # resumed: nothing left to train
    out = capsys.readouterr().out
    assert out.count("already finished, skipped") == 2 and "learning: training" not in out
    assert r2["parent_run_id"] == r1["parent_run_id"] and r2["rows"][0]["gain"] == g
    assert json.loads((out_dir / "tiny_bf16-seed0" / "learning.json").read_text())["seed"] == 0
