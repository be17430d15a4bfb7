"""KV-scale calibration on tiny randomly initialised Qwen3 / Llama models built locally (no downloads)."""
import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from fp8core.rl.kv_calibration import (  # noqa: E402
    calibrate_kv_scales,
    collect_qkv_amax,
    find_attention_modules,
    scales_from_amax,
    validate_kv_scales,
)

E4M3_MAX = 448.0


def _tiny(kind="qwen3", layers=2, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="eager")
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.train()


def _batches(seed=0, n=3, b=2, t=6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (b, t), generator=g)
        mask = torch.ones(b, t, dtype=torch.long)
        mask[1, :2] = 0  # left padding on the second row
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_capture_equals_what_the_attention_kernel_receives(kind, monkeypatch):
    """Hooks + re-applied RoPE reproduce exactly the q/k/v handed to the attention kernel (post q/k-norm, post-RoPE)."""
    model = _tiny(kind)
    mod = __import__(type(find_attention_modules(model)[0]).__module__, fromlist=["eager_attention_forward"])
    seen = []
    original = mod.eager_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(mod, "eager_attention_forward", spy)
    mb = _batches(n=1)[0]
    amax = collect_qkv_amax(model, [mb])
    assert len(seen) == 2
    valid = mb["attention_mask"].bool()
    for layer, (q, k, v) in enumerate(seen):
        for key, x in (("q", q), ("k", k), ("v", v)):
            want = x.abs().amax(dim=(1, 3))[valid].max().item()  # [B, H, T, D] -> valid tokens
            assert amax[key][0, layer].item() == pytest.approx(want, rel=1e-6), (key, layer)
    assert model.training  # mode restored
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # hooks removed


class _Planted(nn.Module):
    def __init__(self, tensor):
        super().__init__()
        self.tensor = tensor

    def forward(self, x):
        return self.tensor.to(x.dtype)


def test_planted_tensor_gives_hand_computed_scales():
    # one micro-batch, 1 sequence of 4 tokens, last token padded (right padding); layer 0's pre-RoPE K (the k_norm
    # output) and V (v_proj output) are replaced by planted tensors.
    model = _tiny("qwen3")
    attn = find_attention_modules(model)[0]
    B, T, Hkv, D = 1, 4, 2, 8
    k = torch.zeros(B, T, Hkv, D)
    k[0, 0, 1, 3] = -5.0  # position 0: RoPE is the identity (cos 1, sin 0) -> |k| = 5
    k[0, 2, 0, 0] = 6.0  # position 2, channel 0 (inv_freq = theta**0 = 1): pair (6, 0) rotates to (6 cos 2, 6 sin 2)
    k[0, 3, 0, 0] = 1000.0  # padded token: must be ignored
    v = torch.zeros(B, T, Hkv * D)
    v[0, 1, 5] = -7.5
    v[0, 3, 0] = 1e4  # padded
    attn.k_norm = _Planted(k)
    attn.v_proj = _Planted(v)
    mb = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    scales = calibrate_kv_scales(model, [mb], percentile=99.9, margin=1.05)
    k_amax = max(5.0, 6.0 * abs(math.cos(2.0)), 6.0 * abs(math.sin(2.0)))  # = 6 sin 2 ~ 5.4558
    assert scales["k_scale"][0] == pytest.approx(k_amax * 1.05 / E4M3_MAX, rel=1e-6)
    assert scales["v_scale"][0] == pytest.approx(7.5 * 1.05 / E4M3_MAX, rel=1e-6)
    assert set(scales) == {"q_scale", "k_scale", "v_scale"} and all(len(v) == 2 for v in scales.values())


def test_scales_change_when_weights_change():
    model = _tiny("qwen3")
    batches = _batches()
    before = calibrate_kv_scales(model, batches)
    attn0 = find_attention_modules(model)[0]
    with torch.no_grad():
        attn0.v_proj.weight.mul_(2.0)  # V is linear in v_proj (no bias) -> v scale doubles exactly
        attn0.k_norm.weight.mul_(2.0)  # post-norm K doubles, RoPE is linear -> k scale doubles
    after = calibrate_kv_scales(model, batches)
    assert after["v_scale"][0] == pytest.approx(2 * before["v_scale"][0], rel=1e-5)
    assert after["k_scale"][0] == pytest.approx(2 * before["k_scale"][0], rel=1e-5)
    assert after["q_scale"][0] == pytest.approx(before["q_scale"][0], rel=1e-6)  # q untouched in layer 0
    assert after["q_scale"][1] != before["q_scale"][1]  # layer 1 sees a different residual stream


def test_percentile_and_margin_behave_as_documented():
    amax = {"q": torch.tensor([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0], [4.0, 5.0], [10.0, 5.0]]),
            "k": torch.ones(5, 2), "v": torch.zeros(5, 2)}
    s = scales_from_amax(amax, percentile=99.9, margin=1.05)
    # linear interpolation: index (5 - 1) * 0.999 = 3.996 -> 4 + 0.996 * (10 - 4) = 9.976
    assert s["q_scale"] == pytest.approx([9.976 * 1.05 / 448, 5.0 * 1.05 / 448])
    assert scales_from_amax(amax, percentile=100, margin=1.0)["q_scale"][0] == pytest.approx(10 / 448)
    assert scales_from_amax(amax, percentile=50, margin=1.0)["q_scale"][0] == pytest.approx(3 / 448)
    assert scales_from_amax(amax, fmt="e5m2", margin=1.0)["k_scale"] == pytest.approx([1 / 57344] * 2)
    assert all(x > 0 and math.isfinite(x) for x in s["v_scale"])  # all-zero layer: floored, never 0/NaN
    # on the model: margin scales linearly, percentile 0 / 100 pick the min / max micro-batch amax
    model = _tiny("qwen3")
    batches = _batches(n=4)
    raw = collect_qkv_amax(model, batches)
    s1 = calibrate_kv_scales(model, batches, margin=1.0, percentile=100)
    s2 = calibrate_kv_scales(model, batches, margin=2.0, percentile=100)
    s0 = calibrate_kv_scales(model, batches, margin=1.0, percentile=0)
    for key in "qkv":
        assert s1[f"{key}_scale"] == pytest.approx((raw[key].max(0).values / 448).tolist(), rel=1e-6)
        assert s0[f"{key}_scale"] == pytest.approx((raw[key].min(0).values / 448).tolist(), rel=1e-6)
        assert s2[f"{key}_scale"] == pytest.approx([2 * x for x in s1[f"{key}_scale"]], rel=1e-9)
    with pytest.raises(ValueError, match="percentile"):
        scales_from_amax(amax, percentile=101)


def test_validation_names_the_layer():
    good = {"q_scale": [0.1, 0.2], "k_scale": [0.1, 0.2], "v_scale": [0.1, 0.2]}
    validate_kv_scales(good, num_layers=2)
    with pytest.raises(ValueError, match="'q_scale' has 2 layers, model has 3"):
        validate_kv_scales(good, num_layers=3)
    with pytest.raises(ValueError, match="'k_scale' has 3 layers, model has 2"):
        validate_kv_scales({**good, "k_scale": [0.1, 0.2, 0.3]}, num_layers=2)
    with pytest.raises(ValueError, match="'v_scale' layer 1"):
        validate_kv_scales({**good, "v_scale": [0.1, float("nan")]}, num_layers=2)
    with pytest.raises(ValueError, match="'q_scale' layer 0"):
        validate_kv_scales({**good, "q_scale": [0.0, 0.2]}, num_layers=2)
    with pytest.raises(ValueError, match="missing key 'v_scale'"):
        validate_kv_scales({"q_scale": [1.0], "k_scale": [1.0]}, num_layers=1)
    # an overflowing layer in the model itself is reported with its index
    model = _tiny("qwen3")
    attn1 = find_attention_modules(model)[1]
    with torch.no_grad():
        attn1.v_proj.weight.fill_(float("inf"))
    with pytest.raises(ValueError, match="'v_scale' layer 1"):
        calibrate_kv_scales(model, _batches(n=1))


def test_bad_micro_batch_is_named():
    model = _tiny("qwen3")
    with pytest.raises(ValueError, match="micro-batch 0 has no 'input_ids'"):
        calibrate_kv_scales(model, [{"ids": torch.zeros(1, 2, dtype=torch.long)}])
    assert all(not m._forward_hooks for m in model.modules())


def test_round_through_e4m3_values_and_straight_through_gradient():
    from fp8core.rl.kv_calibration import round_through_e4m3

    scale = 0.01
    x = torch.tensor([0.0, 0.0123, -1.0, 4.47, 5.0, -6.0], requires_grad=True)  # 4.48 = 448 * scale: the range
    y = round_through_e4m3(x, scale)
    ref = (x.detach() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(y.detach(), ref)
    assert y[4].item() == pytest.approx(4.48) and y[5].item() == pytest.approx(-4.48)  # saturated
    g = torch.tensor([1.0, 2.0, 3.0, 0.3, 5.0, 6.0])
    y.backward(g)
    # passes unchanged inside the range (torch's own float8 cast rounds the gradient to FP8 too), 0 where saturated
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0, 0.3, 0.0, 0.0]))
    bf = round_through_e4m3(torch.tensor([1.0, 3.3], dtype=torch.bfloat16), 0.05)
    assert bf.dtype == torch.bfloat16
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            round_through_e4m3(x, bad)
