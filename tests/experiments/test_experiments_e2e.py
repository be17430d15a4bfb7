"""The reference experiments (experiments/recipe_table.py, experiments/paper_study.py), shortened: one seed of a few
RL steps per arm through the real pipeline (Prefect flow, Ray actors, vLLM), as child MLflow runs of one parent --
the recipe table's BF16 reference and an FP8 arm (the paired comparison), the paper study's Calibrated-Clipping arm
alone (its calibrations, BF16 shadow and ablation row; the comparison with BF16 is the recipe table's code path); the
tables and PNG plots from the finished runs; a rerun skips the finished runs and reuses the parent."""
from pathlib import Path

import pytest
from _runs import check_refits_and_mismatch

ROOT = Path(__file__).resolve().parents[2]
# the 5-step warm start these shortened experiments share (built once, cached like runs/test-env/ops-assets)
SMALL_ASSETS = ROOT / "runs" / "test-env" / "small-assets"


def _small(steps: int) -> list[str]:
    return [f"grpo.max_num_steps={steps}", "grpo.max_val_samples=8", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4", "grpo.val_period=1", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8", "grpo.dynamic_sampling=false", "evaluation.sets=[]",
            "evaluation.num_samples=0", "checkpointing.enabled=false", f"bootstrap.assets_dir={SMALL_ASSETS}",
            "bootstrap.sft_steps=5"]


def _children(uri: str, parent_id: str):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    parent = c.get_run(parent_id)
    kids = c.search_runs([parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return c, parent, kids


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_recipe_table_two_arms_end_to_end(tmp_path, capsys, monkeypatch):
    from experiments.recipe_table import recipe_table

    monkeypatch.chdir(ROOT)  # the arms name their recipes relative to the repository
    out = tmp_path / "rt"
    r1 = recipe_table(["bf16", "fp8-rollout-no-is"], [0], _small(2), str(out), n_boot=200)
    text = capsys.readouterr().out
    assert "recipe_table: training bf16-seed0" in text and "recipe_table: training fp8-rollout-no-is-seed0" in text
    rows = {r["arm"]: r for r in r1["rows"]}
    assert set(rows) == {"bf16", "fp8-rollout-no-is"}
    f = rows["fp8-rollout-no-is"]
    assert f["last_step"] == 2 and sorted(f["curve"]) == [0, 1, 2] and f["val_prompts"] == 8
    assert 0.9 < f["token_mult_prob_error"]["value"] < 1.5 and f["step_s"]["value"] > 0
    assert f["vs_ref"]["lo"] <= f["vs_ref"]["value"] <= f["vs_ref"]["hi"]
    table = (out / "recipe_table.md").read_text()
    assert "`fp8-rollout-no-is`" in table and "(reference)" in table
    assert (out / "plots" / "recipe_table.png").stat().st_size > 10_000
    uri = f"sqlite:///{out / 'mlflow.db'}"
    c, parent, kids = _children(uri, r1["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert sorted(k.data.tags["recipe_table.arm"] for k in kids) == ["bf16", "fp8-rollout-no-is"]
    for k in kids:
        check_refits_and_mismatch(c, k.info.run_id)
    # the FP8-rollout arm really ran without IS: no importance-sampling metrics in its run
    no_is = next(k for k in kids if k.data.tags["recipe_table.arm"] == "fp8-rollout-no-is")
    assert not any(k.startswith("is/") for k in no_is.data.metrics)
    assert {"recipe_table.md", "plots"} <= {a.path for a in c.list_artifacts(r1["parent_run_id"])}

    r2 = recipe_table(["bf16", "fp8-rollout-no-is"], [0], _small(2), str(out), n_boot=200)
    text = capsys.readouterr().out
    assert text.count("already finished, skipped") == 2 and "recipe_table: training" not in text
    assert r2["parent_run_id"] == r1["parent_run_id"]
    # the rerun trained nothing: the runs' origin is still the first invocation's, which trained both
    assert r2["provenance"] == r1["provenance"] and len(r1["provenance"]) == 1, r1["provenance"]
    assert r1["provenance"][0].startswith("- runs trained at commit `") and \
        r1["provenance"][0].endswith(": bf16 seed 0, fp8-rollout-no-is seed 0")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_paper_study_calibrated_clipping_end_to_end(tmp_path, capsys, monkeypatch):
    from experiments.paper_study import paper_study

    monkeypatch.chdir(ROOT)
    out = tmp_path / "ps"
    # K = 1 over 3 steps: 3 calibrations (the minimum), and the K = 1 row of the interval ablation is that arm
    r = paper_study([0], ["blockwise"], 1, [1], "blockwise", _small(3), str(out), n_boot=200,
                    arms=["fp8-blockwise-cc"])
    rows = {x["arm"]: x for x in r["rows"]}
    assert set(rows) == {"fp8-blockwise-cc"} and r["ablation"] == {1: "fp8-blockwise-cc"}
    cc = rows["fp8-blockwise-cc"]
    assert cc["shadow"]["calibrations"]["value"] == 3 and cc["shadow"]["s_per_calibration"]["value"] > 0
    assert 0 < cc["shadow"]["share_of_wall"]["value"] < cc["shadow"]["share_of_step_time"]["value"] < 1
    # logged at each calibration, finite (it is 0 when no update moved the policy: a 5-step SFT often earns no
    # reward at all, so every advantage is 0 and r = 1 in both precisions; tests/trainer/test_policy.py checks > 0)
    assert 0 <= cc["ratio_error_amplification"]["value"] < 1e4
    assert 0.5 <= cc["bound_low_last"] <= 0.9 and 1.2 <= cc["bound_high_last"] <= 2.0
    table = (out / "paper_study.md").read_text()
    assert "| 1 | `fp8-blockwise-cc` |" in table
    for png in ("paper_study.png", "paper_study_intervals.png"):
        assert (out / "plots" / png).stat().st_size > 10_000
    c, parent, kids = _children(f"sqlite:///{out / 'mlflow.db'}", r["parent_run_id"])
    assert parent.info.status == "FINISHED" and len(kids) == 1
    run = next(k for k in kids if k.data.tags["paper_study.arm"] == "fp8-blockwise-cc")
    check_refits_and_mismatch(c, run.info.run_id)
    hist = c.get_metric_history(run.info.run_id, "calib/ratio_error_amplification")
    assert sorted(m.step for m in hist) == [1, 2, 3]
    # the FP8 policy and its BF16 shadow differ on the sampled tokens' probabilities at every calibration
    assert all(m.value > 0 for m in c.get_metric_history(run.info.run_id, "calib/prob_abs_err"))
