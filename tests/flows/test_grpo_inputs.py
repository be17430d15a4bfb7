"""Bad input stops the fp8-grpo flow with a clear error before any worker starts."""
import json
from pathlib import Path

import pytest

from flows.grpo import _progress, main, resolve_paths

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "tiny_bf16.yaml")


def test_cli_rejects_bad_config(capsys):
    assert main([RECIPE, "grpo.max_num_stepz=2"]) == 2
    assert "config error: grpo.max_num_stepz: unknown key" in capsys.readouterr().err
    assert main([RECIPE, "policy.generation.vllm_cfg.kv_cache_dtype=fp8", "calibration.kv_scales_period=0"]) == 2
    assert "calibration.kv_scales_period" in capsys.readouterr().err
    assert main([]) == 2


def test_paths_and_progress_line():
    from configs.schema import load_config

    cfg = load_config(RECIPE, ["run_dir=/tmp/x", "checkpointing.checkpoint_dir=s3://b/p"])
    assert resolve_paths(cfg) == (Path("/tmp/x"), "s3://b/p")
    assert resolve_paths(load_config(RECIPE, ["run_dir=/tmp/x"]))[1] == "/tmp/x/checkpoints"
    line = _progress(3, 20, {"reward/mean": 0.5, "mismatch/token_mult_prob_error": 1.01, "time/step_s": 12.0}, 0.4)
    assert line.startswith("step   3/20 | reward 0.500 | val_acc 0.400 | mismatch 1.0100")


@pytest.mark.slow
def test_missing_dataset_file_and_column_fail_before_workers(tmp_path):
    import ray

    from workers.data import DataError
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                             TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    base = [f"run_dir={tmp_path}", f"policy.model_name={model}", "logger.mlflow_enabled=false"]
    from flows.grpo import grpo

    with pytest.raises(DataError, match=r"nope\.jsonl: dataset file not found"):
        grpo(RECIPE, base + [f"data.train_path={tmp_path}/nope.jsonl", f"data.validation_path={tmp_path}/nope.jsonl"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl: no answer column 'answer'"):
        grpo(RECIPE, base + [f"data.train_path={rows}", f"data.validation_path={rows}"])
    assert not ray.is_initialized()


def test_ray_temp_dir_fits_unix_socket_limit(monkeypatch, tmp_path):
    from workers.cluster import ray_temp_dir

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    assert ray_temp_dir(Path("/r")) == "/r/ray"
    long_dir = Path("/work/main/runs/smoke_tiny_fp8_tensorwise_cc")  # 48 bytes with /ray: too long for Ray
    tmp = ray_temp_dir(long_dir)
    socket = f"{tmp}/session_2026-11-29_09-35-28_297401_31018/sockets/plasma_store"
    assert tmp.startswith("/tmp/ray-") and len(socket) <= 107
    monkeypatch.setenv("RAY_TMPDIR", "/tmp/x")
    assert ray_temp_dir(long_dir) == "/tmp/x"
