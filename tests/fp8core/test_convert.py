"""fp8core.convert on tiny Qwen3 / Llama models built locally from configs (random init, nothing downloaded)."""
import pytest
import torch
import transformers
from torch import nn

from fp8core.convert import convert_to_fp8, decoder_layers, fp8_layer_indices, fp8_modules, high_precision
from fp8core.linear import FP8Linear, FP8LinearConfig
from fp8core.spec import FP8Spec

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=128, tie_word_embeddings=False)


def tiny_qwen3(layers=2, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(num_hidden_layers=layers, **COMMON)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype)


def tiny_llama(layers=3, seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **COMMON))


@pytest.fixture
def one_thread():
    """Tiny GEMMs: one thread is faster, and immune to OpenMP spin-waits when the CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fp8_layer_indices():
    assert fp8_layer_indices(6, 1, 2) == [1, 2, 3]
    assert fp8_layer_indices(4) == [0, 1, 2, 3]
    assert fp8_layer_indices(3, 2, 1) == []
    with pytest.raises(ValueError, match=r"num_first_layers_in_bf16 \(2\) \+ num_last_layers_in_bf16 \(2\) = 4 "
                                         r"exceeds the model's 3 decoder layers"):
        fp8_layer_indices(3, 2, 2)
    with pytest.raises(ValueError, match="num_last_layers_in_bf16 must be a non-negative int"):
        fp8_layer_indices(3, 0, -1)


@pytest.mark.parametrize("build,n_layers", [(tiny_qwen3, 2), (tiny_llama, 3)])
def test_convert_decoder_linears_only(build, n_layers, one_thread):
    model = build()
    keys_before = list(model.state_dict())
    params_before = {n: p for n, p in model.named_parameters()}
    names = convert_to_fp8(model, FP8LinearConfig(), num_first_layers_in_bf16=1)
    assert names == [f"model.layers.{i}.{s}" for i in range(1, n_layers) for s in LINEARS]
    assert [n for n, _ in fp8_modules(model)] == names
    # the BF16 layer, embeddings, lm_head and norms untouched; parameters are the same objects; keys unchanged
    assert not any(isinstance(m, FP8Linear) for m in model.model.layers[0].modules())
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert list(model.state_dict()) == keys_before
    assert all(p is params_before[n] for n, p in model.named_parameters())


def test_convert_last_layers_and_idempotent():
    model = tiny_llama(layers=3)
    names = convert_to_fp8(model, FP8LinearConfig(), num_last_layers_in_bf16=2)
    assert names == [f"model.layers.0.{s}" for s in LINEARS]
    again = convert_to_fp8(model, FP8LinearConfig(recipe="tensorwise"), num_last_layers_in_bf16=2)
    assert again == names and model.model.layers[0].mlp.up_proj.config.recipe == "tensorwise"


def test_convert_errors_name_the_problem():
    with pytest.raises(ValueError, match="Sequential has no decoder layer list.*model.model.layers"):
        convert_to_fp8(nn.Sequential(nn.Linear(4, 4)), FP8LinearConfig())
    with pytest.raises(ValueError, match=r"\(1\) \+ num_last_layers_in_bf16 \(2\) = 3 exceeds the model's 2"):
        convert_to_fp8(tiny_qwen3(), FP8LinearConfig(), num_first_layers_in_bf16=1, num_last_layers_in_bf16=2)
    with pytest.raises(ValueError, match="config must be an FP8LinearConfig"):
        convert_to_fp8(tiny_qwen3(), "blockwise")
    prefix, layers = decoder_layers(tiny_qwen3().model)  # a bare decoder works too
    assert prefix == "layers" and len(layers) == 2


def test_high_precision_shadow_forward(one_thread):
    ref = tiny_qwen3(seed=3)
    model = tiny_qwen3(seed=3)
    convert_to_fp8(model, FP8LinearConfig())
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        fp8 = model(ids).logits
        with high_precision(model):
            shadow = model(ids).logits
        again = model(ids).logits
    assert torch.equal(shadow, want)  # same master weights, no FP8: exactly the original model
    assert torch.equal(again, fp8)  # switches restored
    assert not torch.equal(fp8, want)
    rel = ((fp8 - want).norm() / want.norm()).item()
    print(f"tiny Qwen3 logits, FP8 blockwise vs FP32: relative L2 error {rel:.4f}")
    assert rel < 0.1
    with pytest.raises(RuntimeError), high_precision(model):
        raise RuntimeError("boom")
    assert all(m.fp8_enabled for _, m in fp8_modules(model))


# Tolerance for FP8 vs BF16 training: per-step loss within 2% relative (measured max 0.4-0.6% over 6 steps; ~2 s).
LOSS_RTOL = 0.02
# the recipes the training test compares with BF16 (rowwise with pow2 scales, as torchao's rowwise)
SPECS = {"blockwise": FP8Spec(), "blockwise_hybrid": FP8Spec(fmt="hybrid"),
         "rowwise": FP8Spec(recipe="rowwise", pow2_weight=True, pow2_activation=True),
         "tensorwise": FP8Spec(recipe="tensorwise")}


def _train(preset, steps=6):
    model = tiny_qwen3(seed=0, dtype=torch.bfloat16)
    if preset is not None:
        SPECS[preset].convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_tiny_qwen3_fp8_training_tracks_bf16(one_thread):
    base = _train(None)
    assert base[-1] < base[0] - 1.0  # it learns
    for preset in ("blockwise", "blockwise_hybrid", "rowwise", "tensorwise"):
        losses = _train(preset)
        rel = max(abs(a - b) / b for a, b in zip(losses, base, strict=True))
        print(f"train {preset:16s} losses {[round(v, 3) for v in losses]} (bf16 {[round(v, 3) for v in base]}) "
              f"max rel diff {rel:.4f}")
        assert rel <= LOSS_RTOL, preset
