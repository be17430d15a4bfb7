"""The trainer's memory model (trainer/memory_model.py): parameter counts against the models the pipeline builds, the
activation count against what autograd saves in the trainer's own forward, and the terms on hand-computed shapes.
Its agreement with measured peaks is bench.memory's table (docs/results/memory-live.md), not a test."""
from pathlib import Path

import pytest
import torch

from trainer.memory_model import ModelShape, predict_peak

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


def _built(name, **size):
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(ROOT / "runs" / "test-env" / name, TinyModelSpec(tokenizer_corpus_size=2000, **size))


@pytest.fixture(scope="module")
def dense_dir():
    return _built("policy-tiny", num_hidden_layers=2)


@pytest.fixture(scope="module")
def moe_dir():
    return _built("policy-tiny-moe", num_hidden_layers=2, num_experts=4)


def _shape(model_dir) -> ModelShape:
    import json

    return ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))


@pytest.mark.parametrize("which", ["dense_dir", "moe_dir"])
def test_parameter_counts_are_the_built_model_s(which, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(which)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    s = _shape(model_dir)
    assert s.params == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert s.layer_params == sum(p.numel() for p in layer.parameters())
    attn = sum(m.weight.numel() for m in layer.self_attn.modules() if isinstance(m, torch.nn.Linear))
    assert s.attention_params == attn


def _saved_bytes(worker, rollouts) -> tuple[int, int, int]:
    """Bytes autograd saves in one training forward of the trainer (PolicyWorker._token_logp), deduplicated by
    storage: (activations, logits-sized, tokens), leaving out parameters and weight-shaped tensors (FP8 cache)."""
    from trainer.batch import Batch

    b = Batch.from_rollouts(rollouts, pad_id=worker.tokenizer.pad_token_id or 0)
    params = {p.untyped_storage().data_ptr() for p in worker.model.parameters()}
    shapes = {tuple(p.shape) for p in worker.model.parameters()}
    seen: dict[int, tuple[int, tuple]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and tuple(t.shape) not in shapes:
            seen.setdefault(st.data_ptr(), (st.nbytes(), tuple(t.shape)))
        return t

    vocab = worker.model.config.vocab_size
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        worker._token_logp(b)
    logits = sum(n for n, shape in seen.values() if shape[-1] == vocab)
    return sum(n for n, _ in seen.values()) - logits, logits, int(b.tokens.numel())


@pytest.mark.parametrize("which, ac, autocast", [("dense_dir", False, False), ("dense_dir", True, False),
                                                 ("moe_dir", False, False), ("dense_dir", False, True),
                                                 ("moe_dir", False, True)])
def test_activation_count_is_what_the_trainer_s_forward_saves(which, ac, autocast, request):
    """The per-token count (6 h + 4 i + 4 q + 4 kv per dense layer, + 3 h; h per layer with checkpointing; the MoE
    layer's k (3 h + 4 i_expert) + 2 E) against autograd's saved tensors in the pipeline's FP8 forward: within 5% (measured: 0.3-0.5%).
    Under BF16 autocast (native BF16 forced, as on a GPU) the attention's 2 q + 2 kv and the output projection's input
    are BF16, the rest FP32 (measured: 0.4% dense, 1.8% MoE)."""
    from bench.memory import config, fixed_rollouts
    from trainer.policy import PolicyWorker

    model_dir = request.getfixturevalue(which)  # the memory bench's recipe (FP8, FP32 trainer)
    cfg = config("configs/tiny_fp8_e2e.yaml", 1, [f"policy.megatron_cfg.activation_checkpointing={str(ac).lower()}",
                                                   *(["policy.precision=bfloat16", "policy.bf16_mode=native"]
                                                     if autocast else [])])
    worker = PolicyWorker(model_dir, cfg)
    s = _shape(model_dir)
    rollouts, _ = fixed_rollouts(s.vocab)
    saved, logits, tokens = _saved_bytes(worker, rollouts)
    p = predict_peak(s, world=1, micro_batch_tokens=tokens, activation_checkpointing=ac, autocast=autocast)
    # with checkpointing the forward saves only each layer's input; the recompute's full layer comes in the backward
    want = p["activations"] - (tokens * s.layer_activation_bytes(autocast) if ac else 0)
    print(f"saved {saved / MB:.2f} MB, counted {want / MB:.2f} MB")
    assert saved == pytest.approx(want, rel=0.05), (saved / MB, want / MB)
    assert 0 < logits <= p["logits"]  # what the forward saves of the logits; the term also holds their gradient


def test_terms_on_a_hand_computed_shape():
    s = ModelShape(vocab=100, hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, head_dim=64)
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128 + 2 * 64
    assert s.layer_params == layer and s.root_params == 2 * 100 * 128 + 128
    assert s.params == 2 * layer + 2 * 100 * 128 + 128
    assert s.layer_activation_elems() == 6 * 128 + 4 * 128 + 4 * 64 + 4 * 256
    one = predict_peak(s, world=1, micro_batch_tokens=10, micro_batches=2)
    assert one["optimizer"] == 8 * s.params and one["gradients"] == 4 * s.params
    assert one["fp8_weight_cache"] == 5 * s.fp8_params and one["gathered_layers"] == 0
    assert one["activations"] == 10 * (2 * s.layer_activation_elems() + 3 * 128) * 4
    assert one["logits"] == 10 * 100 * 12 and one["backward_transients"] == 10 * s.layer_activation_elems() * 4
    two = predict_peak(s, world=2, micro_batch_tokens=10, micro_batches=2, fp8="native", prefetch=1,
                       process_constant=7.0)
    assert two["optimizer"] == 4 * s.params and two["fp8_weight_cache"] == 0
    assert two["gathered_layers"] == 12 * layer + 8 * s.root_params / 2 + 128 * 256
    assert two["total"] == pytest.approx(sum(v for k, v in two.items() if k != "total"))
    assert two["process_constant"] == 7.0
    # one micro-batch: gradients grow as activations are freed; the peak holds the larger of the two
    single = predict_peak(s, world=1, micro_batch_tokens=10, micro_batches=1)
    assert single["gradients"] == max(0.0, 4 * s.params - single["activations"])
    ac = predict_peak(s, world=1, micro_batch_tokens=10, activation_checkpointing=True)
    assert ac["activations"] == 10 * (2 * 128 + s.layer_activation_elems() + 3 * 128) * 4
    # BF16 autocast: the attention's 2 q + 2 kv elements and the output projection's input in 2 B, the rest 4 B
    au = predict_peak(s, world=1, micro_batch_tokens=10, autocast=True)
    assert s.layer_activation_bytes(True) == 4 * s.layer_activation_elems() - 2 * (2 * 128 + 2 * 64)
    assert au["activations"] == 10 * (2 * s.layer_activation_bytes(True) + 10 * 128)
    assert au["backward_transients"] == 10 * s.layer_activation_bytes(True)


@pytest.mark.parametrize("kwargs, needle", [(dict(world=0), "world"), (dict(micro_batches=0), "micro_batches"),
                                            (dict(fp8="fp4"), "fp8")])
def test_bad_arguments_are_named(kwargs, needle):
    s = ModelShape(vocab=8, hidden=128, intermediate=128, layers=1, heads=2, kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match=needle):
        predict_peak(s, **{"world": 1, "micro_batch_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config({"vocab_size": 8, "hidden_size": 128, "num_attention_heads": 2})
