"""End to end from hub ids: ``policy.model_name=ORG/NAME`` and the data keys naming a hub dataset, all found offline
in a Hugging Face cache in the hub's layout, run one RL step through the real pipeline; the run records the hub ids
and the commits it pinned, and its checkpoint carries the snapshot's files (what the FP8 export reads)."""
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from _hub import add_dataset, add_model  # noqa: E402
from _runs import check_refits_and_mismatch  # noqa: E402


def _addition_rows(n: int, seed: int) -> list[dict]:
    from rewards.addition_task import make_problem

    rng = random.Random(seed)
    return [{k: v for k, v in make_problem(rng).items() if k in ("question", "answer")} for _ in range(n)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_rl_step_from_a_hub_model_and_a_hub_dataset(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from embedded.tiny_model import TinyModelSpec, build_tiny_model
    from flows.grpo import grpo

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                             TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    rev = add_model(cache, "acme/tiny-qwen3", model)
    splits = {"train": _addition_rows(16, 1), "validation": _addition_rows(4, 2)}
    data_rev = add_dataset(cache, "acme/addition", {None: splits})
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [f"logger.mlflow.tracking_uri={db}", "checkpointing.checkpoint_dir=ck", "grpo.max_num_steps=1",
              "grpo.val_at_start=false", "grpo.max_val_samples=4", "grpo.num_prompts_per_step=4",
              "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
              "policy.train_micro_batch_size=8", "grpo.dynamic_sampling=false"]
    s = grpo(str(ROOT / "configs" / "tiny_bf16.yaml"),
             [*common, f"run_dir={tmp_path / 'run'}", "policy.model_name=acme/tiny-qwen3",
              "data.train_path=acme/addition", "data.validation_path=acme/addition"])
    assert s["steps_run"] == 1 and s["val_accuracy_end"] is not None
    assert "step   1/1 | reward" in capsys.readouterr().out
    params = MlflowClient(tracking_uri=db).get_run(s["mlflow_run_id"]).data.params
    assert params["policy.model_name"] == "acme/tiny-qwen3" and params["data.train_path"] == "acme/addition"
    assert params["hub/policy.model_name"] == f"acme/tiny-qwen3@{rev}"
    assert params["hub/data.train_path"] == params["hub/data.validation_path"] == f"acme/addition@{data_rev}"
    ck = Path(s["checkpoint"])
    for name in ("config.json", "tokenizer.json"):  # the pinned snapshot's files, byte for byte
        assert (ck / name).read_bytes() == (model / name).read_bytes(), name
    assert list((tmp_path / "run").glob("cache/hf")) == []  # no run-local hub cache any more

    # the same run from the directory and local files: the same samples, rewards, update and validation
    for name, rows in splits.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = grpo(str(ROOT / "configs" / "tiny_bf16.yaml"),
             [*common, f"run_dir={tmp_path / 'run-dir'}", f"policy.model_name={model}",
              f"data.train_path={tmp_path / 'train.jsonl'}", f"data.validation_path={tmp_path / 'validation.jsonl'}"])
    c = MlflowClient(tracking_uri=db)
    for key in ("reward/mean", "rollout/generated_tokens", "loss/pg", "train/grad_norm", "val/accuracy"):
        hub_h = [(m.step, m.value) for m in c.get_metric_history(s["mlflow_run_id"], key)]
        dir_h = [(m.step, m.value) for m in c.get_metric_history(d["mlflow_run_id"], key)]
        assert hub_h and hub_h == dir_h, (key, hub_h, dir_h)
    for run_id in (s["mlflow_run_id"], d["mlflow_run_id"]):
        check_refits_and_mismatch(c, run_id)
