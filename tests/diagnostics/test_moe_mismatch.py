"""The dense-vs-MoE mismatch table through its entry point (``diagnostics.moe_mismatch.main``) on the briefly SFT-ed
tiny models: one rollout per recipe, scored by that recipe's trainer with routing replay off and (MoE) on."""
import json
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "runs" / "test-env" / "models"


@pytest.mark.slow
def test_moe_mismatch_table(tmp_path):
    from diagnostics.mismatch import quick_sft_model
    from diagnostics.moe_mismatch import format_table, main

    dense, moe = quick_sft_model(MODELS), quick_sft_model(MODELS, moe=True, steps=20)
    table = main(["--dense-model-dir", str(dense), "--moe-model-dir", str(moe), "--task", "arithmetic",
                  "--prompts", "4", "--n", "2", "--max-tokens", "16", "--run-dir", str(tmp_path / "run"),
                  "--json", str(tmp_path / "t.json"),
                  "--set", "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216"])
    assert json.loads((tmp_path / "t.json").read_text()) == table
    print("\n" + format_table(table))
    rows = table["rows"]
    assert list(rows) == ["dense/bf16", "dense/fp8", "moe/bf16", "moe/fp8"]
    assert [table["recipes"][k]["recipe"] for k in rows] == [
        "configs/tiny_bf16.yaml", "configs/tiny_fp8_e2e.yaml", "configs/tiny_moe_bf16.yaml",
        "configs/tiny_moe_fp8_e2e.yaml"]
    for key, by_replay in rows.items():
        if key.startswith("dense"):
            assert list(by_replay) == ["off"] and "moe/routing_mismatch_frac" not in by_replay["off"]
            continue
        off, on = by_replay["off"], by_replay["on"]
        assert (off["moe/router_replay"], on["moe/router_replay"]) == (0.0, 1.0)  # the recipe's trainer setting
        assert off["tokens"] == on["tokens"]  # one rollout, scored twice
        assert 0.0 <= off["moe/routing_mismatch_frac"] < 0.2
        assert 1.0 <= off["mismatch/token_mult_prob_error"] < 1.1 and 1.0 <= on["mismatch/token_mult_prob_error"] < 1.1
