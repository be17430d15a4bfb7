"""Bad input stops the fp8-grpo flow with a clear error before any worker starts."""
import json
from pathlib import Path

import pytest

from flows.grpo import main, resolve_paths
from flows.run_report import progress_line

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
    line = progress_line(3, 20, {"reward/mean": 0.5, "mismatch/token_mult_prob_error": 1.01, "time/step_s": 12.0}, 0.4)
    assert line.startswith("step   3/20 | reward 0.500 | val_acc 0.400 | mismatch 1.0100")


@pytest.mark.slow
def test_missing_dataset_file_and_column_fail_before_workers(tmp_path):
    import ray

    from data.loading import DataError
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                             TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    base = [f"run_dir={tmp_path}", f"policy.model_name={model}", "logger.mlflow_enabled=false"]
    from flows.grpo import grpo

    with pytest.raises(DataError, match=r"nope\.jsonl: dataset file not found"):
        grpo(RECIPE, base + [f"data.train_path={tmp_path}/nope.jsonl", f"data.validation_path={tmp_path}/nope.jsonl"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl:1: no answer key 'answer'"):
        grpo(RECIPE, base + [f"data.train_path={rows}", f"data.validation_path={rows}"])
    assert not ray.is_initialized()


def test_debug_switch_shows_the_traceback_instead_of_one_line(monkeypatch, capsys):
    from configs.schema import ConfigError

    assert main([RECIPE, "policy.optimizer.lr=-1"]) == 2
    assert capsys.readouterr().err == "config error: policy.optimizer.lr: must be > 0, got -1.0\n"
    monkeypatch.setenv("FP8GRPO_DEBUG", "1")
    with pytest.raises(ConfigError, match=r"policy\.optimizer\.lr: must be > 0"):
        main([RECIPE, "policy.optimizer.lr=-1"])


def test_kv_cache_impl_key_is_validated(capsys):
    assert main([RECIPE, "policy.generation.vllm_cfg.kv_cache_impl=emulated"]) == 2
    assert "policy.generation.vllm_cfg.kv_cache_impl: emulated only applies with" in capsys.readouterr().err
    assert main([RECIPE, "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
                 "policy.generation.vllm_cfg.kv_cache_impl=fast"]) == 2
    assert "policy.generation.vllm_cfg.kv_cache_impl" in capsys.readouterr().err


def test_invalid_cpu_cap_fails_at_the_cli(monkeypatch, capsys):
    monkeypatch.setenv("FP8GRPO_CPU_CAP", "avx3")
    assert main([RECIPE]) == 2
    assert "FP8GRPO_CPU_CAP='avx3' is not one of avx2, avx512, avx512_bf16, amx" in capsys.readouterr().err


@pytest.mark.slow
def test_native_fp8_kv_refused_at_load_under_the_avx2_cap(monkeypatch, tmp_path):
    """What vLLM would refuse fails before any worker starts, naming the key and the missing CPU feature (or the head
    size); auto picks the emulated cache instead. The driver's view follows FP8GRPO_CPU_CAP (no patching needed)."""
    import json as _json
    import shutil

    import ray

    from cluster.runtime import check_rollout_kv
    from configs.schema import ConfigError, load_config
    from embedded.tiny_model import TinyModelSpec, build_tiny_model
    from flows.grpo import grpo

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                             TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    kv = [f"policy.model_name={model}", "policy.generation.vllm_cfg.kv_cache_dtype=fp8"]
    monkeypatch.setenv("FP8GRPO_CPU_CAP", "avx2")
    native = load_config(RECIPE, kv + ["policy.generation.vllm_cfg.kv_cache_impl=native"])
    # "kind avx2, capped by FP8GRPO_CPU_CAP=avx2" where the cap lowers the kind; "kind avx2" on an AVX2-only CPU
    with pytest.raises(ConfigError, match=r"kv_cache_impl=native.*kind avx2(, capped by FP8GRPO_CPU_CAP=avx2)?\) "
                                          r"lacks AVX-512"):
        check_rollout_kv(native, model)
    assert check_rollout_kv(load_config(RECIPE, kv), model)[0] == "fp8-emulated"
    rows = tmp_path / "rows.jsonl"  # explicit data: no embedded-assets bootstrap before the check
    rows.write_text(_json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match="kv_cache_impl=native"):
        grpo(RECIPE, kv + [f"run_dir={tmp_path}", "logger.mlflow_enabled=false", f"data.train_path={rows}",
                           f"data.validation_path={rows}", "policy.generation.vllm_cfg.kv_cache_impl=native"])
    assert not ray.is_initialized()
    monkeypatch.delenv("FP8GRPO_CPU_CAP")
    odd = tmp_path / "head80"
    shutil.copytree(model, odd)
    mcfg = _json.loads((odd / "config.json").read_text())
    mcfg["head_dim"] = 80
    (odd / "config.json").write_text(_json.dumps(mcfg))
    from fp8core.cpu import cpu_caps

    # the head-size refusal, where this CPU has the FP8 KV cache at all (on an AVX2-only CPU the CPU refuses first;
    # the head-size rule itself is tested CPU-independently in tests/rollout/test_rollout.py)
    why = "head_size 80 is not a multiple of 32" if cpu_caps().kind != "avx2" else "lacks AVX-512"
    with pytest.raises(ConfigError, match=f"kv_cache_impl=native.*{why}"):
        check_rollout_kv(native, odd)


def test_compiled_engine_with_the_emulated_fp8_kv_cache_is_refused_before_any_worker_starts():
    """The emulated FP8 KV cache rounds K / V in a Python hook that a compiled engine would run with the scales of
    its trace: refused at load time, naming the key; native and BF16 caches compile."""
    from cluster.runtime import check_rollout_kv
    from configs.schema import ConfigError, load_config
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                             TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    compiled = [f"policy.model_name={model}", "policy.generation.vllm_cfg.enforce_eager=false"]
    emulated = ["policy.generation.vllm_cfg.kv_cache_dtype=fp8", "policy.generation.vllm_cfg.kv_cache_impl=emulated"]
    with pytest.raises(ConfigError, match=r"^policy.generation.vllm_cfg.enforce_eager: false cannot run the "
                                          r"emulated FP8 KV cache"):
        check_rollout_kv(load_config(RECIPE, compiled + emulated), model)
    assert check_rollout_kv(load_config(RECIPE, compiled[:1] + emulated), model)[0] == "fp8-emulated"
    assert check_rollout_kv(load_config(RECIPE, compiled), model)[0] == "bf16"


def test_ray_temp_dir_fits_unix_socket_limit(monkeypatch, tmp_path):
    from cluster.runtime import ray_temp_dir

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    assert ray_temp_dir(Path("/r")) == "/r/ray"
    long_dir = Path("/home/user/runs/smoke_tiny_fp8_tensorwise_cc")  # 48 bytes with /ray: too long for Ray
    tmp = ray_temp_dir(long_dir)
    socket = f"{tmp}/session_2026-11-29_09-35-28_297401_31018/sockets/plasma_store"
    assert tmp.startswith("/tmp/ray-") and len(socket) <= 107
    monkeypatch.setenv("RAY_TMPDIR", "/tmp/x")
    assert ray_temp_dir(long_dir) == "/tmp/x"
