"""The (a)-(e) train/inference mismatch table through its entry point (``diagnostics.mismatch.main``) on the (briefly
SFT-ed) tiny model, and the one-path check: each row is exactly what a RolloutWorker + PolicyWorker built from the
row's recipe give on their own."""
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from configs.schema import load_config
from diagnostics.mismatch import ROWS, format_table, fp8_overrides
from fp8core.cpu import cpu_caps

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"
BUDGET = "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216"
PROMPTS, N, TOKENS = 8, 2, 24


def test_fp8_settings_go_to_the_section_that_owns_them():
    fp8 = {"fp8_recipe": "rowwise", "pow2_weight_scaling_factors": True}
    assert fp8_overrides(ROOT / "configs" / "tiny_bf16.yaml", fp8) == []
    assert fp8_overrides(ROOT / "configs" / "tiny_fp8_rollout.yaml", fp8) == [
        'policy.generation.vllm_cfg.fp8_recipe="rowwise"', "policy.generation.vllm_cfg.pow2_weight_scaling_factors=true"]
    over = fp8_overrides(ROOT / "configs" / "tiny_fp8_e2e_kv.yaml", fp8)
    assert over[0] == 'policy.megatron_cfg.fp8_cfg.fp8_recipe="rowwise"'
    cfg = load_config(ROOT / "configs" / "tiny_fp8_e2e_kv.yaml", over)
    assert cfg.rollout_fp8_spec() == cfg.trainer_fp8_spec() and cfg.rollout_fp8_spec().recipe == "rowwise"


def test_results_file_layout():
    """docs/results/mismatch.md's layout (tools.results): title, writer, what the rows measure, the stamp, the
    settings, then the table."""
    from diagnostics.mismatch import format_results
    from tools.results import stamp

    m = {"mismatch/token_mult_prob_error": 1.0006, "mismatch/kl_k3_rollout_train": 1.14e-05,
         "mismatch/max_abs_logp_diff": 0.195, "tokens": 5173}
    eng = {"kv_capacity_tokens": 32768, "kv_cache_memory_bytes": 67108864, "kv_mode": "bf16", "bf16_mode": "off"}
    origin = stamp("diagnostics.mismatch", ["--prompts", "32"])
    table = {"rows": {"a": m}, "recipes": {"a": {"recipe": "configs/tiny_bf16.yaml", "describe": "BF16 / FP32"}},
             "engines": {"a": eng}, "model_dir": "runs/assets/m", "stamp": origin,
             "settings": {"prompts": 32, "task": "addition", "n": 4, "seed": 0, "overrides": ["x=1"], "fp8": {}}}
    lines = format_results(table).splitlines()
    assert lines[0] == "# Train/inference mismatch per recipe: results" and lines[1] == ""
    assert lines[2].startswith("Written by `") and lines[2].endswith(
        " -m diagnostics.mismatch`; the next run of that command overwrites this file.")
    assert lines[4].startswith("What each row measures: [the FP8 contract]")
    assert lines[6:11] == [f"- commit: `{origin['commit']}`" + (
        f" (uncommitted changes in {', '.join(origin['dirty_files'])})" if origin["dirty_files"] else ""),
        f"- date: {origin['date']}", f"- CPU: {origin['cpu_model']} (kind `{origin['cpu_kind']}`)",
        f"- command: `{origin['command']}`", "- model: `runs/assets/m`; 32 addition prompts x n=4, seed 0; sampling "
        "and scoring at each recipe's policy.generation settings"]
    assert lines[11:14] == ["", "- overrides (every row): `x=1`; FP8 settings: `-`", ""]
    assert "\n".join(lines[14:]) == format_table(table)


@pytest.fixture(scope="module")
def diag(tmp_path_factory):
    """The diagnostic run through its entry point: (model_dir, tmp dir, returned table, the JSON it wrote)."""
    from diagnostics.mismatch import main, quick_sft_model

    model_dir = quick_sft_model(MODELS)
    tmp = tmp_path_factory.mktemp("mismatch")
    table = main(["--model-dir", str(model_dir), "--task", "arithmetic", "--prompts", str(PROMPTS), "--n", str(N),
                  "--max-tokens", str(TOKENS), "--set", BUDGET, "--run-dir", str(tmp / "run"),
                  "--json", str(tmp / "table.json"), "--out", str(tmp / "mismatch.md")])
    return model_dir, tmp, table, json.loads((tmp / "table.json").read_text())


@pytest.mark.slow
def test_mismatch_table_a_to_d(diag):
    _, tmp, table, saved = diag
    print("\n" + format_table(saved))
    err = {k: v["mismatch/token_mult_prob_error"] for k, v in saved["rows"].items()}
    assert err["a"] <= 1.01
    # (b) and (c) score the same samples (two engines, one FP8 numerics): the FP8 trainer reproduces the engine's FP8
    # linears exactly, so it is closer than the FP32 trainer; FP8 KV adds error on top (native CPU cache:
    # truncation toward zero; emulated, on CPUs without AVX-512/AMX: round to nearest, about half the cache error).
    assert table["scored"]["b"]["rollouts"] == table["scored"]["c"]["rollouts"]
    assert err["c"] < err["b"]
    assert err["d"] > err["c"]
    assert all(1.0 <= e < 1.1 for e in err.values())
    native = cpu_caps().native_fp8_kv
    eng = saved["engines"]
    assert eng["d"]["kv_mode"] == ("fp8-native" if native else "fp8-emulated")
    # 16 MiB / 2048 vs 1024 bytes per token; the emulated FP8 cache stores BF16 (capacity gain not realised)
    assert [eng[k]["kv_capacity_tokens"] for k in "abcd"] == [8192, 8192, 8192, 16384 if native else 8192]
    assert list(saved["kv_scales"]) == ["d"] and len(saved["kv_scales"]["d"]["k_scale"]) == 4
    md = (tmp / "mismatch.md").read_text()
    for part in (saved["stamp"]["commit"], f"kind `{cpu_caps().kind}`", "-m diagnostics.mismatch --model-dir",
                 format_table(saved)):
        assert part in md


def _prompts(model_dir) -> list[str]:
    """The diagnostic's prompts, written out: ``--task arithmetic``, ``random.Random(1234)``."""
    from transformers import AutoTokenizer

    from embedded.tiny_model import chat_prompt
    from rewards.math_task import make_problem

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(1234)
    return [chat_prompt(tok, make_problem(rng)["question"], "arithmetic") for _ in range(PROMPTS)]


def _generate(model_dir, cfg, prompts, run_dir, kv_scales=None):
    from rollout.engine import RolloutWorker

    engine = RolloutWorker(model_dir, cfg, run_dir=run_dir)
    try:
        if kv_scales is not None:
            engine.set_kv_scales(kv_scales)
        return engine.generate(prompts, n=N, max_tokens=TOKENS, temperature=cfg.policy.generation.temperature,
                               seed=0)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_rows_are_what_the_recipes_engine_and_trainer_give(diag):
    """One measurement path: per row, an engine and a trainer built here from the row's recipe (same overrides,
    seed and prompts) sample the same tokens and score them to the same logprobs and metrics, bit for bit, as the
    diagnostic reported. Row (d): the K/V scales are that trainer's calibration on an FP8 rollout of the same prompts
    without the FP8 KV cache. The control shows the check can fail: a BF16-weight copy of the model (the
    diagnostics' old trainer) scores row (a)'s tokens differently."""
    from transformers import AutoModelForCausalLM

    from fp8core.rl import mismatch_metrics
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _probes import model_logprobs

    from trainer.policy import PolicyWorker

    model_dir, tmp, table, saved = diag
    prompts = _prompts(model_dir)
    for key, recipe in ROWS.items():
        cfg = load_config(ROOT / "configs" / recipe, [BUDGET, f"policy.generation.max_new_tokens={TOKENS}",
                                                      f"run_dir={tmp / 'own' / key}"])
        policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
        scales = None
        if key == "d":
            no_kv = load_config(ROOT / "configs" / recipe, [BUDGET, f"policy.generation.max_new_tokens={TOKENS}",
                                                            "policy.generation.vllm_cfg.kv_cache_dtype=auto"])
            calib = _generate(model_dir, no_kv, prompts, tmp / "own" / "calib")
            scales = policy.calibrate_kv_scales(calib, max_samples=cfg.calibration.kv_calibration_samples)
            assert scales == saved["kv_scales"]["d"]
        rollouts = _generate(model_dir, cfg, prompts, tmp / "own" / key / "rollout", scales)
        assert rollouts == table["scored"][key]["rollouts"], key
        own = policy.score(rollouts)
        assert torch.equal(own["logp"], table["scored"][key]["logp"]), key
        assert own["metrics"] == saved["rows"][key], key
        print(f"({key}) {recipe}: token_mult_prob_error {own['metrics']['mismatch/token_mult_prob_error']:.6f} "
              "(diagnostic and own build identical)")
    bf16 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    lp, b = model_logprobs(bf16, table["scored"]["a"]["rollouts"], pad_id=policy.tokenizer.pad_token_id)
    ours = table["scored"]["a"]["logp"]
    assert not torch.equal(lp * b.mask, ours * b.mask)
    other = mismatch_metrics(lp, b.rollout_logp, b.mask)
    print(f"control: row (a)'s tokens scored by a BF16-weight model: token_mult_prob_error "
          f"{other['mismatch/token_mult_prob_error']:.6f} vs {saved['rows']['a']['mismatch/token_mult_prob_error']:.6f}")
    assert other != {k: v for k, v in saved["rows"]["a"].items() if k != "tokens"}
