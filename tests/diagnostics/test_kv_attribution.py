"""trainer.kv_rounding.kv_rounding: the trainer-side replica of the engine's FP8 KV rounding (no engine here)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp8core.rl.kv_calibration import calibrate_kv_scales, collect_qkv_amax  # noqa: E402
from trainer.kv_rounding import _Saturation, kv_rounding  # noqa: E402


def _tiny(seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, attn_implementation=attn)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0  # right padding, as the trainer's logprob pass pads
    return ids, mask


@torch.no_grad()
def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_rounding_is_the_models_own_attention_and_the_implementation_is_restored(attn):
    model = _tiny(attn=attn)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    scales = calibrate_kv_scales(model, [{"input_ids": ids, "attention_mask": mask}])
    with kv_rounding(model, scales, round_k=False, round_v=False):
        assert model.config._attn_implementation.startswith("fp8grpo_kv_round")
        same = _logits(model, ids, mask)
    assert torch.equal(same, ref)
    assert model.config._attn_implementation == attn
    assert torch.equal(_logits(model, ids, mask), ref)


@pytest.mark.parametrize("round_k,round_v", [(True, False), (False, True), (True, True)])
def test_rounding_moves_the_logits_by_fp8_sized_amounts(round_k, round_v):
    model = _tiny()
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    scales = calibrate_kv_scales(model, [{"input_ids": ids, "attention_mask": mask}])
    with kv_rounding(model, scales, round_k=round_k, round_v=round_v):
        out = _logits(model, ids, mask)
    diff = (out - ref).abs().max()
    assert 0 < diff < 0.1 * ref.abs().max()  # E4M3's 3 mantissa bits: a few percent, not nothing, not garbage


def test_saturation_counts_the_same_post_rope_k_and_v_the_calibration_measures():
    """With the scale at the real tokens' max (percentile 100, margin 1 + 1e-4) nothing saturates; 1% lower, K and V
    each have saturated elements: so the tensors it sees are the calibration's (post-RoPE K, V), padding excluded."""
    model = _tiny()
    ids, mask = _batch()
    amax = collect_qkv_amax(model, [{"input_ids": ids, "attention_mask": mask}])
    for margin, saturated in ((1.0001, False), (0.99, True)):  # 1.0001: 448 * (a / 448) may round below a
        scales = {f"{k}_scale": (amax[k][0] * margin / 448.0).tolist() for k in "qkv"}
        sat = _Saturation()
        with kv_rounding(model, scales, round_k=False, round_v=False, saturation=sat):  # rounding would change
            _logits(model, ids, mask)                                                  # the next layer's K / V
        frac = sat.fractions()
        assert (frac["k"] > 0) == saturated and (frac["v"] > 0) == saturated, (margin, frac)
        assert sat.total["k"] == 2 * int(mask.sum()) * 8  # layers x real tokens x head_dim (any head)


def test_training_through_the_rounding_gets_a_straight_through_gradient():
    """The replay in a training forward: gradients reach every parameter, and the K/V rounding is the only change
    (the same loss without rounding gives gradients within FP8-sized differences, not zero and not garbage)."""
    model = _tiny().train()
    ids, mask = _batch()
    scales = calibrate_kv_scales(model, [{"input_ids": ids, "attention_mask": mask}])
    model.train()

    def grads(round_kv):
        model.zero_grad()
        ctx = kv_rounding(model, scales, round_k=round_kv, round_v=round_kv)
        with ctx:
            model(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, rounded = grads(False), grads(True)
    assert plain.keys() == rounded.keys() and len(plain) == len(list(model.parameters()))
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    rel = ((rounded[k_proj] - plain[k_proj]).norm() / plain[k_proj].norm()).item()
    assert 0 < rel < 0.2, rel


@pytest.mark.slow
def test_attribution_through_its_entry_point(tmp_path):
    """``diagnostics.kv_attribution.main`` on the briefly SFT-ed tiny model: engine and trainers built from the FP8-KV
    recipe, scales calibrated by its trainer on an FP8 rollout without the FP8 KV cache, and the five rows scored
    on the same sequences (the reference on the calibration rollout)."""
    import json
    import random
    from pathlib import Path

    from diagnostics.kv_attribution import AS_TRAINED, BOTH, K_ONLY, REFERENCE, V_ONLY, format_attribution, main
    from diagnostics.mismatch import quick_sft_model
    from fp8core.cpu import cpu_caps
    from rewards.math_task import make_problem

    model_dir = quick_sft_model(Path(__file__).resolve().parents[2] / "runs" / "test-env" / "models")
    rng = random.Random(0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": make_problem(rng)["question"]}) + "\n" for _ in range(8)))
    table = main(["--model-dir", str(model_dir), "--data", str(data), "--prompts", "4", "--n", "2",
                  "--max-tokens", "24", "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "t.json"),
                  "--set", "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216"])
    print("\n" + format_attribution(table))
    assert json.loads((tmp_path / "t.json").read_text())["rows"] == table["rows"]
    assert list(table["rows"]) == [REFERENCE, AS_TRAINED, K_ONLY, V_ONLY, BOTH]
    err = {k: m["mismatch/token_mult_prob_error"] for k, m in table["rows"].items()}
    tokens = {m["tokens"] for k, m in table["rows"].items() if k != REFERENCE}
    assert len(tokens) == 1 and table["sequences"] == 8  # the four settings score the same FP8-KV rollout
    assert all(e >= 1.0 for e in err.values())
    assert len({err[AS_TRAINED], err[K_ONLY], err[V_ONLY], err[BOTH]}) == 4  # each rounding changes the scores
    assert table["kv_mode"] == ("fp8-native" if cpu_caps().native_fp8_kv else "fp8-emulated")
    assert len(table["kv_scales"]["k_scale"]) == 4 and all(0.0 <= f < 0.01 for f in table["saturation"].values())
