"""FP8 on the tiny Qwen3-MoE through the pipeline's refit path: after a real trainer update and
``PolicyWorker.refit_weights()`` -> ``RolloutWorker.refit``, the engine's experts hold the trainer's FP8 codes and
scales bit for bit (each expert's gate / up / down, 128x128 blocks), each expert layer's output for the same inputs
and routing is bit-identical to the trainer's, the router is FP32 on both sides and routes the same, the whole
engine tracks the FP8 trainer (token-mult-prob-error), and KV-scale calibration runs on the MoE trainer."""
from pathlib import Path

import pytest
import torch

from configs.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"
FIRST = 1  # layer 0 kept in BF16: its experts are high precision on both sides

pytestmark = pytest.mark.slow  # vLLM engine + a real train step


@pytest.fixture(scope="module")
def model_dir():
    from diagnostics.mismatch import quick_sft_model

    return quick_sft_model(MODELS, moe=True, steps=20)


def _cfg(run_dir, *extra):
    f8 = "policy.megatron_cfg.fp8_cfg"
    return load_config(ROOT / "configs" / "tiny_moe_fp8_e2e.yaml", [
        "policy.precision=float32", "policy.optimizer.lr=1e-3", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
        f"{f8}.num_first_layers_in_bf16={FIRST}", f"{f8}.pow2_weight_scaling_factors=true",
        "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", f"run_dir={run_dir}",
        f"{f8}.backend=cpu", *extra])  # the CPU FP8 GEMM on every CPU kind (auto: the emulation without BF16 units)


def _trained(model_dir, cfg, tmp):
    """A trainer after one real GRPO update on an engine's rollouts (both built from ``cfg``), the engine refit with
    its served weights: (policy, engine, prompts)."""
    import random

    from embedded.tiny_model import chat_prompt
    from rewards.math_task import make_problem, reward
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    engine = RolloutWorker(model_dir, cfg, run_dir=tmp / "rollout")
    rng = random.Random(0)
    rows = [make_problem(rng) for _ in range(2)]
    prompts = [chat_prompt(engine.tokenizer, r["question"]) for r in rows]
    outs = engine.generate(prompts, n=4, max_tokens=16, seed=0)
    rewards = [reward(s["text"], r["answer"]) for o, r in zip(outs, rows, strict=True) for s in o["samples"]]
    rewards[0] = 1.0 - rewards[0]
    assert policy.train_step(outs, rewards, step=1)["train/optimizer_updates"] >= 1
    engine.refit(policy.refit_weights(), weights_version=1)
    return policy, engine, prompts


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    policy, engine, prompts = _trained(model_dir, _cfg(tmp), tmp)
    yield policy, engine, prompts
    engine.shutdown()


def _experts(model, layer: int):
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return next(m for m in model.model.layers[layer].mlp.experts.modules() if isinstance(m, RoutedExperts))


def _held_experts(engine, layer: int, n: int) -> list[dict]:
    """The engine's FP8 experts of ``layer`` as it holds them: per expert {gate / up / down: (codes, scales)}."""
    return engine.llm.apply_model(lambda m: [
        {p: (q.data.clone(), q.scale.clone()) for p, q in _experts(m, layer).quant_method.expert_weights(
            _experts(m, layer), e).items()} for e in range(n)])[0]


def test_engine_experts_hold_the_trainers_fp8_weights_bit_for_bit(pair):
    policy, engine, _ = pair
    from fp8core.moe import FP8Experts

    n_layers = policy.model.config.num_hidden_layers
    assert not isinstance(policy.model.model.layers[0].mlp.experts, FP8Experts)  # BF16-kept layer
    checked = 0
    for layer in range(FIRST, n_layers):
        ex = policy.model.model.layers[layer].mlp.experts
        assert isinstance(ex, FP8Experts) and ex.fp8_enabled
        held = _held_experts(engine, layer, ex.num_experts)
        for e in range(ex.num_experts):
            for part in ("gate", "up", "down"):
                q = ex.quantized_weight(e, part)
                d, sc = held[e][part]
                assert torch.equal(d.view(torch.uint8), q.data.view(torch.uint8)), (layer, e, part)
                assert torch.equal(sc, q.scale), (layer, e, part)
                assert bool((torch.log2(sc) == torch.round(torch.log2(sc))).all())  # pow2 honoured
                checked += 1
    assert checked == 3 * 8 * (n_layers - FIRST)


def test_expert_layer_and_router_outputs_bit_identical_for_the_same_inputs(pair):
    policy, engine, _ = pair
    h = policy.model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, h, generator=gen) * 2).to(torch.bfloat16)
    for layer in (0, FIRST, policy.model.config.num_hidden_layers - 1):
        mlp = policy.model.model.layers[layer].mlp

        def engine_side(m, i=layer):
            blk = m.model.layers[i].mlp
            logits = blk.gate(x)[0]
            ex = _experts(m, i)
            w, ids = blk.experts.router.select_experts(hidden_states=x, router_logits=logits,
                                                        topk_indices_dtype=None)
            return logits, w, ids, ex.quant_method.apply(ex, x, w, ids)

        logits_e, w_e, ids_e, y_e = engine.llm.apply_model(engine_side)[0]
        with torch.no_grad():
            logits_t, w_t, ids_t = mlp.gate(x)
            assert logits_e.dtype == logits_t.dtype == torch.float32
            torch.testing.assert_close(logits_e, logits_t, rtol=1e-6, atol=1e-6)
            assert torch.equal(ids_e.long(), ids_t) and torch.equal(w_e, w_t), layer  # same routing rule
            y_t = mlp.experts(x, ids_e.long(), w_e)
        if layer >= FIRST:  # FP8 experts: bit for bit
            assert torch.equal(y_e, y_t), layer
        else:  # BF16-kept experts: engine BF16 GEMMs vs trainer FP32 masters (close, not equal)
            torch.testing.assert_close(y_e.float(), y_t.float(), rtol=0.05, atol=0.05)


def _moe_engine_state(engine, x: torch.Tensor) -> tuple[dict, dict]:
    """Every engine parameter (FP8 as bytes) and every experts layer's output on ``x`` routed by its own router
    (what the experts' GEMMs read from their packed form, not only the codes)."""
    def read(m):
        params = {n: (p.detach().view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.detach()).clone()
                  for n, p in m.named_parameters()}
        outs = {}
        for i, layer in enumerate(m.model.layers):
            ex = _experts(m, i)
            w, ids = layer.mlp.experts.router.select_experts(hidden_states=x, router_logits=layer.mlp.gate(x)[0],
                                                             topk_indices_dtype=None)
            outs[i] = ex.quant_method.apply(ex, x, w, ids)
        return params, outs

    return engine.llm.apply_model(read)[0]


def test_in_place_moe_refit_equals_vllms_reload(pair):
    """The served MoE refit is copied in place (rollout/inplace_refit.py: the FP8 experts' codes and scales, the
    BF16-kept layer's experts rounded, the FP32 router through its loader): from a different engine state it
    leaves every parameter and every experts layer's output what vLLM's layerwise reload leaves."""
    policy, engine, _ = pair
    x = (torch.randn(23, policy.model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2
         ).to(torch.bfloat16)
    payload = policy.refit_weights()
    other = {n: (torch.zeros_like(t) if t.dtype == torch.uint8 else  # codes 0, scales 1, the rest halved
                 torch.ones_like(t) if n.endswith("_scale_inv") else t / 2) for n, t in payload.items()}
    try:
        engine.refit(other, weights_version=1)
        moved = _moe_engine_state(engine, x)
        engine.refit(payload, weights_version=1)
        assert engine.stats()["refit_loader"] == "in_place"
        in_place = _moe_engine_state(engine, x)
        engine.refit(other, weights_version=1)
        engine._inplace_refit = False
        engine.refit(payload, weights_version=1)
        assert engine.stats()["refit_loader"] == "vllm_reload"
        reloaded = _moe_engine_state(engine, x)
    finally:
        engine._inplace_refit = True
        engine.refit(payload, weights_version=1)
    assert in_place[0].keys() == reloaded[0].keys()
    assert all(torch.equal(in_place[0][k], reloaded[0][k]) for k in in_place[0])
    assert all(torch.equal(in_place[1][i], reloaded[1][i]) for i in in_place[1])
    assert not any(torch.equal(moved[1][i], in_place[1][i]) for i in moved[1])
    assert not torch.equal(moved[0]["model.layers.0.mlp.experts.routed_experts.w13_weight"],
                           in_place[0]["model.layers.0.mlp.experts.routed_experts.w13_weight"])


def test_expert_layer_rows_in_any_batch_equal_the_trainers_batch(pair):
    """The engine's FP8 expert layer fed a batch in decode-like pieces (1, 2, 8 and 29 tokens: each expert's GEMM
    sees other token counts) returns, in FP32, the trainer's expert layer on the whole batch bit for bit."""
    policy, engine, _ = pair
    x = torch.randn(40, policy.model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2
    pieces = [(0, 1), (1, 3), (3, 11), (11, 40)]

    def engine_side(m):
        blk, ex = m.model.layers[FIRST].mlp, _experts(m, FIRST)
        w, ids = blk.experts.router.select_experts(hidden_states=x, router_logits=blk.gate(x)[0],
                                                    topk_indices_dtype=None)
        return w, ids, torch.cat([ex.quant_method.apply(ex, x[i:j], w[i:j], ids[i:j]) for i, j in pieces])

    w, ids, y_engine = engine.llm.apply_model(engine_side)[0]
    with torch.no_grad():
        y_trainer = policy.model.model.layers[FIRST].mlp.experts(x, ids.long(), w)
    assert y_engine.dtype == torch.float32 and torch.equal(y_engine, y_trainer)


def test_fp8_moe_engine_tracks_the_fp8_trainer_and_kv_calibration_runs(pair):
    policy, engine, prompts = pair
    outs = engine.generate(prompts, n=4, max_tokens=24, seed=1)
    err = policy.score(outs)["metrics"]["mismatch/token_mult_prob_error"]  # the trainer's own scoring forward
    print(f"MoE FP8 engine vs FP8 trainer token_mult_prob_error {err:.4f}")
    assert err < 1.05
    scales = policy.calibrate_kv_scales(outs, max_samples=8)
    n = policy.model.config.num_hidden_layers
    assert len(scales["k_scale"]) == n and all(s > 0 for s in scales["k_scale"] + scales["v_scale"])
    engine.refit(policy.refit_weights(), kv_scales=scales, weights_version=policy.step)  # the engine takes them


def test_routing_capture_and_replay(pair):
    """The engine returns each token's experts; the trainer's own choice mostly agrees; with replay on the trainer
    uses exactly the engine's experts; moe/* metrics are logged by train_step."""
    from fp8core.moe import routers
    from trainer.batch import Batch

    policy, engine, prompts = pair
    outs = engine.generate(prompts, n=4, max_tokens=24, seed=5, routing=True)
    smp = outs[0]["samples"][0]
    seq = outs[0]["prompt_token_ids"] + smp["token_ids"]
    n_layers = policy.model.config.num_hidden_layers
    assert smp["routed_experts"].shape == (len(seq), n_layers, 2) and smp["routed_experts"].dtype == torch.int16
    assert int(smp["routed_experts"].min()) >= 0 and int(smp["routed_experts"].max()) < 8
    assert torch.equal(engine.routed_experts(seq), smp["routed_experts"])  # deterministic
    assert "routed_experts" not in engine.generate(prompts[:1], n=1, max_tokens=4)[0]["samples"][0]  # opt-in

    b = Batch.from_rollouts(outs, pad_id=policy.tokenizer.pad_token_id)
    errs = {}
    for replay in (False, True):
        policy.router_replay = replay
        errs[replay] = policy.score(outs)["metrics"]["mismatch/token_mult_prob_error"]
    # the last forward (replay on, the whole batch in one logprob batch) used the engine's experts
    r0 = routers(policy.model)[0][1]
    order = torch.argsort(b.attn.sum(1), descending=True, stable=True)  # logprobs() batches rows longest-first
    w = r0.last_ids.shape[0] // len(b)
    eng = b.routing[order][:, :w, 0].reshape(-1, 2)
    real = b.attn[order][:, :w].reshape(-1).bool()
    assert torch.equal(r0.last_ids[real], eng[real])
    own_diff = (r0.last_own_ids[real].sort(-1).values != eng[real].sort(-1).values).any(-1).float().mean()
    print(f"MoE FP8: routing mismatch {float(own_diff):.4f}; token_mult_prob_error replay off {errs[False]:.5f}, "
          f"on {errs[True]:.5f}")
    assert float(own_diff) < 0.2
    assert errs[True] <= errs[False] + 1e-3
    policy.router_replay = True
    rewards = [float(i % 2) for i in range(8)]
    m = policy.train_step(outs, rewards, step=2)
    policy.router_replay = False
    assert m["moe/router_replay"] == 1.0 and 0.0 <= m["moe/routing_mismatch_frac"] < 0.2
    assert m["moe/expert_load_max"] >= 1.0 >= m["moe/expert_load_min"] >= 0.0 and m["moe/expert_load_cv"] >= 0.0


def test_compiled_moe_engine_gives_the_eager_engines_bits(pair, model_dir, tmp_path):
    """``enforce_eager: false`` on the MoE engine: its experts (FP8 and the BF16-kept layer's) are one op each
    (rollout/engine_ops.py), so the model traces; a compiled and an eager engine, both fresh and refitted with the
    trained weights, sample the same, token ids and logprobs bit for bit."""
    from rollout.engine import RolloutWorker

    policy, _, prompts = pair
    weights = policy.refit_weights()
    samples = []
    for name, extra in (("eager", []), ("compiled", ["policy.generation.vllm_cfg.enforce_eager=false",
                                                     "policy.generation.vllm_cfg.compile_backend=eager"])):
        engine = RolloutWorker(model_dir, _cfg(tmp_path, *extra), run_dir=tmp_path / name)
        try:
            engine.refit(weights, weights_version=1)
            samples.append([[(s["token_ids"], s["logprobs"]) for s in p["samples"]]
                            for p in engine.generate(prompts, n=4, max_tokens=16, seed=3)])
        finally:
            engine.shutdown()
    assert samples[0] == samples[1]


def test_mxfp8_experts_equal_the_trainers_after_a_refit(model_dir, tmp_path):
    """The mxfp8 recipe on the MoE model: after a real update and a served refit (in place), every FP8 expert holds
    the trainer's 1x32-group codes and power-of-two scales bit for bit, and an experts layer's output for the same
    input and routing is the trainer's."""
    f8 = "policy.megatron_cfg.fp8_cfg"
    cfg = _cfg(tmp_path, f"{f8}.fp8_recipe=mxfp8", f"{f8}.pow2_activation_scaling_factors=true")
    policy, engine, _ = _trained(model_dir, cfg, tmp_path)
    try:
        assert engine.stats()["refit_loader"] == "in_place"
        for layer in range(FIRST, policy.model.config.num_hidden_layers):
            ex = policy.model.model.layers[layer].mlp.experts
            held = _held_experts(engine, layer, ex.num_experts)
            for e in range(ex.num_experts):
                for part in ("gate", "up", "down"):
                    q = ex.quantized_weight(e, part)
                    assert q.granularity == "group32" and bool((torch.frexp(q.scale)[0] == 0.5).all())
                    d, sc = held[e][part]
                    assert torch.equal(d.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(sc, q.scale)
        x = (torch.randn(19, policy.model.config.hidden_size, generator=torch.Generator().manual_seed(6)) * 2
             ).to(torch.bfloat16)

        def engine_side(m, i=FIRST):
            blk, ex = m.model.layers[i].mlp, _experts(m, FIRST)
            w, ids = blk.experts.router.select_experts(hidden_states=x, router_logits=blk.gate(x)[0],
                                                        topk_indices_dtype=None)
            return w, ids, ex.quant_method.apply(ex, x, w, ids)

        w_e, ids_e, y_e = engine.llm.apply_model(engine_side)[0]
        with torch.no_grad():
            y_t = policy.model.model.layers[FIRST].mlp.experts(x, ids_e.long(), w_e)
        assert torch.equal(y_e, y_t)
    finally:
        engine.shutdown()
