"""fp8core.moe: FP32 router (vLLM's CPU routing rule), FP8 experts per expert and partition, routing replay, the
checkpoint / served names of fused experts. A tiny random transformers Qwen3-MoE (no download) is the reference."""
import pytest
import torch

from fp8core.convert import convert_to_fp8, high_precision
from fp8core.linear import FP8LinearConfig, fp8_linear_forward
from fp8core.moe import (
    FP8Experts,
    FP32Router,
    checkpoint_state_dict,
    convert_routers,
    expert_load_stats,
    forced_routing,
    route,
    routing_mismatch_frac,
)
from fp8core.quant import quantize
from fp8core.serve import SCALE_SUFFIX, served_state_dict

E, K, H, INTER = 8, 2, 256, 128


def _model(layers: int = 2, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=H, intermediate_size=256, moe_intermediate_size=INTER,
                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # a visible spread of router logits (init std 0.02 makes every expert nearly tied)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def test_route_matches_transformers_router_and_hand_example():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, top_k=2, renormalize=True)
    assert sorted(ids[0].tolist()) == [1, 2]
    got = {int(i): float(v) for i, v in zip(ids[0], w[0], strict=True)}
    e3, e2 = torch.exp(torch.tensor(3.0)), torch.exp(torch.tensor(2.0))
    assert got == pytest.approx({1: float(e3 / (e3 + e2)), 2: float(e2 / (e3 + e2))}, abs=1e-7)
    w2, _ = route(logits, top_k=2, renormalize=False)  # softmax over all experts at the chosen ones
    torch.testing.assert_close(w2.sum(), torch.softmax(logits, -1)[0, 1:3].sum(), rtol=0, atol=1e-6)

    model = _model()
    hf_router = model.model.layers[0].mlp.gate
    x = torch.randn(50, H)
    _, hf_w, hf_ids = hf_router(x)
    r = FP32Router(hf_router)
    logits, w, ids = r(x)
    assert logits.dtype == torch.float32 and w.dtype == torch.float32
    hf_order, our_order = hf_ids.sort(-1), ids.sort(-1)
    assert torch.equal(hf_order.values, our_order.values)
    torch.testing.assert_close(w.gather(-1, our_order.indices), hf_w.gather(-1, hf_order.indices).float(),
                               rtol=1e-5, atol=1e-6)


def test_converted_model_in_high_precision_matches_transformers():
    model = _model()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    convert_routers(model)
    convert_to_fp8(model, FP8LinearConfig())
    assert all(isinstance(layer.mlp.experts, FP8Experts) and isinstance(layer.mlp.gate, FP32Router)
               for layer in model.model.layers)
    with torch.no_grad(), high_precision(model):
        hp = model(input_ids=ids).logits
        assert not model.model.layers[0].mlp.experts.fp8_enabled
    assert model.model.layers[0].mlp.experts.fp8_enabled  # restored
    torch.testing.assert_close(hp, ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        fp8 = model(input_ids=ids).logits
    assert not torch.equal(fp8, hp) and (fp8 - hp).abs().max() < 0.5  # FP8 changes the numbers, not the model


def test_fp8_experts_quantize_gate_and_up_as_separate_blockwise_partitions_bit_for_bit():
    model = _model(layers=1)
    convert_to_fp8(model, FP8LinearConfig(pow2_weight=True))
    ex = model.model.layers[0].mlp.experts
    gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
    for e in (0, 5):
        for part, w in (("gate", gu[e, :INTER]), ("up", gu[e, INTER:]), ("down", dn[e])):
            q, ref = ex.quantized_weight(e, part), quantize(w, "block128", fmt="e4m3", pow2=True)
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale,
                                                                                                  ref.scale)
    # the layer output = the shared loop over fp8_linear_forward with those weights (bit for bit)
    x = torch.randn(40, H, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (40, K))
    ids[:, 1] = (ids[:, 0] + 1) % E
    w = torch.softmax(torch.randn(40, K), -1)
    ex.to(torch.bfloat16)
    with torch.no_grad():
        got = ex(x, ids, w)
    ref = torch.zeros_like(x)
    for e in range(E):
        t, p = torch.where(ids == e)
        if not len(t):
            continue
        lin = lambda v, part, e=e: fp8_linear_forward(v, ex.quantized_weight(e, part))  # noqa: E731
        h = torch.nn.functional.silu(lin(x[t], "gate")) * lin(x[t], "up")
        ref.index_add_(0, t, (lin(h, "down") * w[t, p, None]).to(ref.dtype))
    assert torch.equal(got, ref)


def test_fp8_moe_trains_router_and_experts():
    model = _model()
    convert_routers(model)
    convert_to_fp8(model, FP8LinearConfig())
    ids = torch.randint(0, 64, (2, 10))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    mlp = model.model.layers[1].mlp
    for p in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_routing_replay_forces_experts_and_records_own_choice():
    model = _model()
    convert_routers(model)
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    own = {i: layer.mlp.gate.last_own_ids.clone() for i, layer in enumerate(model.model.layers)}
    with torch.no_grad(), forced_routing(model, own):
        same = model(input_ids=ids).logits
    assert torch.equal(same, ref)  # replaying the router's own choice changes nothing
    forced = {i: (v + 1) % E for i, v in own.items()}
    with torch.no_grad(), forced_routing(model, forced):
        other = model(input_ids=ids).logits
    g0 = model.model.layers[0].mlp.gate
    assert torch.equal(g0.last_ids, forced[0]) and torch.equal(g0.last_own_ids, own[0])
    assert not torch.equal(other, ref)
    assert g0.forced_ids is None  # restored
    assert routing_mismatch_frac(own[0], forced[0]) == 1.0 and routing_mismatch_frac(own[0], own[0].flip(-1)) == 0.0
    assert routing_mismatch_frac(own[0], forced[0], mask=torch.zeros(9)) == 0.0


def test_expert_load_stats():
    st = expert_load_stats(torch.tensor([[0, 1], [2, 3]]), 4)
    assert st == {"max": 1.0, "min": 1.0, "cv": 0.0}
    st = expert_load_stats(torch.tensor([[0, 1], [0, 1]]), 4)
    assert st["max"] == 2.0 and st["min"] == 0.0 and st["cv"] == pytest.approx(1.0)


def test_checkpoint_and_served_names_are_per_expert():
    model = _model(layers=2)
    sd = checkpoint_state_dict(model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in sd
    gu = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(sd["model.layers.0.mlp.experts.3.up_proj.weight"], gu[3, INTER:])
    assert sd["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (H, INTER)
    assert "model.layers.0.mlp.gate.weight" in sd
    convert_routers(model)
    convert_to_fp8(model, FP8LinearConfig(), num_first_layers_in_bf16=1)
    served = served_state_dict(model)
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    assert served[name].dtype == torch.float8_e4m3fn and served[name + SCALE_SUFFIX].shape == (1, 2)
    assert served["model.layers.0.mlp.experts.2.gate_proj.weight"].dtype == torch.bfloat16  # BF16-kept layer
    assert served["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # router: FP32 on both sides
    assert set(served) - {n for n in served if n.endswith(SCALE_SUFFIX)} == set(sd)
