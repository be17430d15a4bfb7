"""The FP8 contract through the pipeline's own refit path: rollout -> reward -> PolicyWorker.train_step (a real AdamW
update, so the FP32 masters leave the BF16 grid) -> ``PolicyWorker.weights()`` -> ``RolloutWorker.refit`` (what
tasks/rl.py ``refit`` sends actor to actor) leaves the engine's FP8 weights bit-identical to the trainer's own
``FP8Linear.quantized_weight()``. The engine is built from the recipe by ``workers.cluster.rollout_config``, as
``start_workers`` does, so the rollout and trainer settings come from the same recipe the pipeline runs.

Before the fix, refit shipped BF16 copies: the engine held ``quantize(bf16(w))`` while the trainer used
``quantize(w)``. The test also checks that such a BF16 refit *would* be caught (it differs after a real update).
"""
from pathlib import Path

import pytest
import torch

from configs.schema import load_config
from fp8core.quant import quantize

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"

pytestmark = pytest.mark.slow  # vLLM engine + a real train step


@pytest.fixture(scope="module")
def model_dir():
    from workers.mismatch import quick_sft_model

    return quick_sft_model(MODELS)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    # pow2 weights and a BF16 first layer: the recipe options the engine must mirror
    over = ["policy.precision=float32", "policy.optimizer.lr=1e-3", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
            "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16=1",
            "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true",
            "policy.generation.vllm_cfg.num_first_layers_in_bf16=1",
            "policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
            "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216",
            f"run_dir={tmp_path_factory.mktemp('refit-contract')}"]
    return load_config(ROOT / "configs" / "tiny_fp8_e2e.yaml", over)


def _engine_fp8(worker) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, list[int]]]:
    def grab(model):
        return {name: (m.weight.data.clone(), getattr(m, "weight_scale_inv", None), list(getattr(m, "logical_widths",
                                                                                                  [])))
                for name, m in model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj",
                                                                       "down_proj"))}

    return worker.llm.apply_model(grab)[0]


_FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
          "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def test_pipeline_refit_after_a_real_update_is_bit_identical_to_trainer(model_dir, cfg):
    from workers.cluster import rollout_config
    from workers.math_task import make_problem, reward
    from workers.policy import PolicyWorker
    from workers.rollout import RolloutWorker
    from workers.tiny_model import chat_prompt

    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    engine = RolloutWorker(model_dir, rollout_config(cfg), run_dir=Path(cfg.run_dir) / "rollout")
    try:
        import random

        rng = random.Random(0)
        rows = [make_problem(rng) for _ in range(cfg.grpo.num_prompts_per_step)]
        outs = engine.generate([chat_prompt(engine.tokenizer, r["question"]) for r in rows],
                               n=cfg.grpo.num_generations_per_prompt, max_tokens=16, seed=0)
        rewards = [reward(s["text"], r["answer"]) for o, r in zip(outs, rows, strict=True) for s in o["samples"]]
        rewards[0] = 1.0 - rewards[0]  # at least one group with mixed rewards: a non-zero update
        m = policy.train_step(outs, rewards, step=1)
        assert m["train/optimizer_updates"] >= 1

        trainer = {name: mod.quantized_weight() for name, mod in policy.model.named_modules()
                   if hasattr(mod, "quantized_weight")}
        masters = policy.model.state_dict()
        assert trainer and all(".layers.0." not in n for n in trainer)  # first layer kept in BF16
        bf16_would_differ = 0
        engine.refit(policy.weights())  # exactly what tasks/rl.py refit sends
        held = _engine_fp8(engine)
        checked = 0
        for name, (data, scale, _) in held.items():
            layer = int(name.split(".")[2])
            if layer < 1:
                assert data.dtype != torch.float8_e4m3fn and scale is None, name
                continue
            sub, parts = _FUSED[name.rsplit(".", 1)[1]]
            row = srow = 0
            for part in parts:
                key = f"model.layers.{layer}.{sub}.{part}"
                q = trainer[key]
                n, nb = q.data.shape[0], q.scale.shape[0]
                assert torch.equal(data[row:row + n].view(torch.uint8), q.data.view(torch.uint8)), key
                assert torch.equal(scale[srow:srow + nb], q.scale), key
                old = quantize(masters[f"{key}.weight"].to(torch.bfloat16), "block128", pow2=True)
                bf16_would_differ += int(not torch.equal(old.data.view(torch.uint8), q.data.view(torch.uint8)))
                row, srow, checked = row + n, srow + nb, checked + 1
        assert checked == len(trainer)
        # the old BF16 refit is not a no-op on trained weights: this test would have caught it
        assert bf16_would_differ > 0
    finally:
        engine.shutdown()
