"""RL learns, checked through the learning experiment (experiments/learning.py) as users run it: the BF16 reference
(BF16 rollouts, FP32 trainer, lr 1e-4) and the end-to-end FP8 recipe train 15 steps each on 16 fixed prompts (every
step trains on all 16, 4 samples each, 4 updates per step; validation is greedy on the same 16) from the pipeline's own 325-step SFT warm start, shared by
the test run (the ``warm_start`` fixture). Each must start at most 0.6 and gain at least 40 points of greedy accuracy:
a pipeline that stops learning -- a wrong gradient or loss sign, an update that never reaches the engine, rewards that
do not reach the loss -- fails here. Each step's rollout ran on the weights of the step before, as the engines
report it, and the mismatch stayed in its recipe's bound. Then the experiment's own promises: child runs of one
parent (the seed shares the warm start: ``bootstrap.sft_seed``), the table, and a rerun that trains nothing.

Measured (greedy accuracy on the 16 prompts, step 0 -> 15): AMD EPYC (avx512_bf16) BF16 0.312 -> 1.000, end-to-end FP8
0.312 -> 1.000, 38-39 s per run (with 8 samples per prompt: 0.312 -> 0.938 and -> 1.000, at twice the cost); the same
CPU under FP8GRPO_CPU_CAP=avx2 (FP32 FP8 GEMM, emulated BF16): both 0.312 -> 0.875, 56-63 s per run on one core."""
import json
from pathlib import Path

import pytest
from _runs import check_refits_and_mismatch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [str(ROOT / "configs" / "tiny_bf16.yaml"), str(ROOT / "configs" / "tiny_fp8_e2e.yaml")]
N_PROMPTS = 16
MAX_START, MIN_GAIN = 0.6, 0.40


def _fixed_prompts(warm_start: dict, path: Path) -> Path:
    """The first 16 prompts of the embedded validation split (2-3 digit additions), as the run's train and validation
    file."""
    rows = Path(warm_start["validation"]).read_text().splitlines()[:N_PROMPTS]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bf16_and_fp8_learn_16_fixed_prompts_in_15_steps(warm_start, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from experiments.learning import learning

    prompts = _fixed_prompts(warm_start, tmp_path / "prompts16.jsonl")
    overrides = ["grpo.max_num_steps=15", f"grpo.num_prompts_per_step={N_PROMPTS}", "grpo.num_generations_per_prompt=4",
                 "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
                 f"grpo.max_val_samples={N_PROMPTS}", "grpo.val_period=15", f"data.train_path={prompts}",
                 f"data.validation_path={prompts}", "evaluation.sets=[]", "evaluation.num_samples=0",
                 "checkpointing.enabled=false", f"bootstrap.assets_dir={warm_start['assets_dir']}"]
    out_dir = tmp_path / "learning"
    r1 = learning(RECIPES, [0], overrides, str(out_dir), n_boot=500)
    out = capsys.readouterr().out
    assert "learning: training tiny_bf16-seed0" in out and "learning: training tiny_fp8_e2e-seed0" in out
    # both runs started from the shared warm start: no other SFT model was built beside it
    assert [p.name for p in (warm_start["assets_dir"] / "addition").glob("tiny-qwen3-sft-seed*")] == \
        ["tiny-qwen3-sft-seed0"]
    uri = f"sqlite:///{out_dir / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri)
    learned = {}
    for row in r1["rows"]:
        (s,) = row["per_seed"]
        learned[Path(row["recipe"]).stem] = (s["acc_start"], s["acc_end"])
        assert s["val_prompts"] == N_PROMPTS and (s["first_step"], s["last_step"]) == (0, 15)
        assert s["format_valid_end"] >= s["format_valid_start"] - 0.01
        check_refits_and_mismatch(c, s["mlflow_run_id"])
    print(f"greedy accuracy on the 16 prompts, step 0 -> 15: {learned}")
    for name, (start, end) in learned.items():
        assert start <= MAX_START, f"{name}: the warm start already answers {start:.3f} of the prompts"
        assert end - start >= MIN_GAIN, f"{name}: {start:.3f} -> {end:.3f}, RL gained less than {MIN_GAIN:.0%}"

    table = (out_dir / "learning.md").read_text()
    assert all(f"`{r}`" in table for r in RECIPES) and "paired bootstrap" in table
    parent = c.get_run(r1["parent_run_id"])
    assert parent.info.status == "FINISHED" and "learning.md" in {a.path for a in c.list_artifacts(parent.info.run_id)}
    children = c.search_runs([parent.info.experiment_id],
                             filter_string=f"tags.`mlflow.parentRunId` = '{r1['parent_run_id']}'")
    assert sorted(ch.data.tags["learning.seed"] for ch in children) == ["0", "0"]
    assert {ch.data.params["bootstrap.sft_seed"] for ch in children} == {"0"}  # the grid's shared warm start

    r2 = learning(RECIPES, [0], overrides, str(out_dir), n_boot=500)  # resumed: nothing left to train
    out = capsys.readouterr().out
    assert out.count("already finished, skipped") == 2 and "learning: training" not in out
    assert r2["parent_run_id"] == r1["parent_run_id"]
    assert json.dumps(r2["rows"]) == json.dumps(r1["rows"])  # the same table from the same runs (one seed: sd NaN)
    assert json.loads((out_dir / "tiny_bf16-seed0" / "learning.json").read_text())["seed"] == 0
