"""experiments.learning's table on hand-made finished runs (no training): per-seed gains from the per-prompt files,
the seed-stratified paired bootstrap, the health columns from MLflow histories, unfinished seeds named."""
import json

import pytest


def _fake_run(root, uri, recipe_stem, seed, start, end, *, entropy=(0.1, 0.08)):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from experiments.learning import _marker

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("t") or c.get_experiment(c.create_experiment("t"))
    run_id = c.create_run(exp.experiment_id).info.run_id
    ms = [Metric("val/format_valid", 1.0, 0, 0), Metric("val/format_valid", 0.9, 0, 2),
          Metric("policy/entropy", entropy[0], 0, 1), Metric("policy/entropy", entropy[1], 0, 2)]
    for step, v in ((1, 0.02), (2, 0.2)):  # in band at step 1 only
        ms += [Metric("clip/lower_neg_adv_frac", v, 0, step), Metric("clip/upper_pos_adv_frac", v / 2, 0, step),
               Metric("reward/frac_groups_all_same", 0.4, 0, step), Metric("time/step_s", 5.0, 0, step),
               Metric("train/dynamic_sampling_filtered_frac", 0.4, 0, step),
               Metric("mismatch/token_mult_prob_error", 1.001, 0, step)]
    c.log_batch(run_id, metrics=ms)
    d = root / f"{recipe_stem}-seed{seed}"
    (d / "val" / "main").mkdir(parents=True)
    files = {}
    for step, vals in ((0, start), (2, end)):
        f = d / "val" / "main" / f"step_{step:06d}.jsonl"
        f.write_text("".join(json.dumps({"id": i, "correct": bool(v)}) + "\n" for i, v in enumerate(vals)))
        files[str(step)] = str(f)
    (d / "summary.json").write_text(json.dumps({"val_accuracy": {"0": 0, "2": 0}, "val_files": {"main": files},
                                                "wall_s": 100.0}))
    (d / "learning.json").write_text(json.dumps({**_marker(f"configs/{recipe_stem}.yaml", seed, []),
                                                 "mlflow_run_id": run_id}))


def test_gain_table_from_finished_runs(tmp_path):
    from experiments.learning import gain_table

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    _fake_run(tmp_path, uri, "tiny_bf16", 0, [0, 0, 0, 1], [1, 1, 0, 1])  # +0.50
    _fake_run(tmp_path, uri, "tiny_bf16", 1, [0, 0, 1, 1], [1, 0, 1, 1])  # +0.25
    recipe = "configs/tiny_bf16.yaml"
    done = {(recipe, 0), (recipe, 1)}
    table, rows = gain_table(tmp_path, [recipe, "configs/tiny_fp8_e2e.yaml"], [0, 1, 2], uri, n_boot=400, done=done)
    (row,) = rows
    assert row["seeds"] == [0, 1] and [s["gain"] for s in row["per_seed"]] == [0.5, 0.25]
    g = row["gain"]
    assert g["value"] == pytest.approx(0.375) and g["lo"] <= 0.375 <= g["hi"] and g["n"] == 8
    m = row["mean"]
    assert m["acc_start"] == pytest.approx(0.375) and m["acc_end"] == pytest.approx(0.75)
    assert m["format_valid_end"] == pytest.approx(0.9) and m["entropy_last"] == pytest.approx(0.08)
    assert m["mean clip/lower_neg_adv_frac"] == pytest.approx(0.11) and m["lower_neg_in_band"] == 0.5
    assert m["upper_pos_in_band"] == 1.0  # 1% and 10%
    assert "**+37.5**" in table and "+50.0, +25.0" in table
    # sd(+50, +25) = 17.7; two arms' difference sqrt(2) x 17.7 = 25 points: (25 x 2.4865 / 3)^2 = 429.3 -> 430 seeds
    assert "seed SD of the gain 17.7 points over 2 seeds; a 3-point difference between two arms then needs 430 " \
           "paired seeds" in table
    assert "Not finished (not in the table): tiny_bf16 seed 2, tiny_fp8_e2e seed 0, tiny_fp8_e2e seed 1, " \
           "tiny_fp8_e2e seed 2." in table


def test_learning_results_file(tmp_path):
    """What ``python -m experiments.learning`` writes when it finishes: the stamped results file with the table."""
    from experiments.learning import write_results_doc
    from tools.results import stamp

    origin = stamp("experiments.learning", ["--seeds", "0"])
    result = {"table": "| recipe |\n|---|\n| `configs/tiny_bf16.yaml` |\n", "out_dir": str(tmp_path / "learning"),
              "parent_run_id": "p123"}
    text = write_results_doc(result, origin, tmp_path / "learning.md").read_text()
    assert text.startswith("# Learning experiment: results\n\nWritten by `")
    assert f"- command: `{origin['command']}`" in text and "-m experiments.learning --seeds 0`" in text
    assert "MLflow parent run `p123`" in text and text.endswith("| `configs/tiny_bf16.yaml` |\n")
