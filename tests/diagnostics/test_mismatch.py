"""The (a)-(d) train/inference mismatch table on the (briefly SFT-ed) tiny model, plus the metric plumbing."""
import random
from pathlib import Path

import pytest
import torch

from diagnostics.mismatch import format_table, mismatch
from fp8core.cpu import cpu_caps

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"


def test_mismatch_of_identical_logprobs_is_one_and_padding_is_ignored():
    lps = [[-0.5, -1.0], [-2.0]]
    m = mismatch([torch.tensor(x) for x in lps], lps)
    assert m["mismatch/token_mult_prob_error"] == 1.0 and m["tokens"] == 3
    # worked example: |d| = 0.1 on one token of three -> (2 + e^0.1) / 3
    m = mismatch([torch.tensor([-0.5, -1.1], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)], lps)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx((2 + torch.e ** 0.1) / 3, rel=1e-9)
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(0.1, rel=1e-6)


@pytest.mark.slow
def test_mismatch_table_a_to_d(tmp_path):
    from diagnostics.mismatch import _tokenizer, mismatch_table, quick_sft_model
    from embedded.math_task import make_problem
    from embedded.tiny_model import chat_prompt

    model_dir = quick_sft_model(MODELS)
    tok = _tokenizer(model_dir)
    rng = random.Random(3)
    prompts = [chat_prompt(tok, make_problem(rng)["question"]) for _ in range(8)]
    base = dict(kv_cache_memory_bytes=16 << 20, max_model_len=256)
    table = mismatch_table(model_dir, run_dir=tmp_path, prompts=prompts, n=2, max_tokens=24, base=base)
    print("\n" + format_table(table))
    err = {k: v["mismatch/token_mult_prob_error"] for k, v in table["rows"].items()}
    assert err["a"] <= 1.01
    # (b) and (c) score the same FP8-engine samples: the FP8 trainer reproduces the engine's FP8 linears exactly,
    # so it is closer than the BF16 trainer; FP8 KV adds error on top (native CPU cache: truncation toward zero;
    # emulated, on CPUs without AVX-512/AMX: round to nearest, about half the cache error).
    assert err["c"] < err["b"]
    assert err["d"] > err["c"]
    assert all(1.0 <= e < 1.1 for e in err.values())
    native = cpu_caps().native_fp8_kv
    assert table["kv_mode"] == ("fp8-native" if native else "fp8-emulated")
    # 16 MiB / 2048 vs 1024 bytes per token; the emulated FP8 cache stores BF16 (capacity gain not realised)
    assert table["kv_capacity_tokens"] == {"bf16": 8192, "fp8": 16384 if native else 8192}
