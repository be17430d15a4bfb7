"""rollout/vllm_bf16.py: the bf16_emulated vLLM linear method computes BF16 numerics (BF16 operands, FP32
accumulation, BF16 result) and an engine using it generates what vLLM's own BF16 engine generates."""
import os
from pathlib import Path

import pytest
import torch

from fp8core.bf16 import round_bf16

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"

pytestmark = pytest.mark.slow  # imports vLLM


def test_apply_is_a_bf16_gemm(single_rank):
    from rollout.vllm_bf16 import Bf16EmulatedConfig, Bf16EmulatedLinearMethod, quantization_config_dict

    cfg = Bf16EmulatedConfig.from_config(quantization_config_dict())
    with pytest.raises(ValueError, match="unknown keys"):
        Bf16EmulatedConfig.from_config({"quant_method": "bf16_emulated", "bogus": 1})
    method = Bf16EmulatedLinearMethod()
    layer = torch.nn.Module()
    widths, k = [256, 128, 128], 256
    method.create_weights(layer, k, widths, k, sum(widths), torch.bfloat16, weight_loader=None)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(sum(widths), k, generator=g) * 0.05  # FP32 masters, as a refit ships them
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight, w.to(torch.bfloat16).float())  # the value vLLM's BF16 weight would hold
    x = (torch.randn(7, k, generator=g) * 3).to(torch.bfloat16)
    y = method.apply(layer, x)
    assert y.dtype == torch.bfloat16
    exact = x.double() @ w.to(torch.bfloat16).double().t()
    assert torch.equal(y, exact.float().to(torch.bfloat16)) or \
        (y.double() - exact).abs().max() <= exact.abs().max() * 2.0**-8
    native = torch.nn.functional.linear(x, w.to(torch.bfloat16))
    assert (y.float() - native.float()).abs().max() <= native.float().abs().max() * 2.0**-7
    y32 = method.apply(layer, x.float() + 1e-3)  # an FP32 engine: operands rounded, result BF16-valued FP32
    assert y32.dtype == torch.float32 and torch.equal(y32, round_bf16(y32))
    assert type(cfg.get_quant_method(torch.nn.Embedding(2, 2), "lm_head")) is type(None)


def test_engine_generates_like_native_bf16():
    """Greedy generations of vLLM's BF16 engine and of the same engine with bf16_emulated linears: the same tokens
    (up to rare near-ties from FP32 summation order) and logprobs within BF16 rounding."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    import rollout.vllm_bf16 as vb
    from diagnostics.mismatch import quick_sft_model
    from embedded.tiny_model import chat_prompt
    from rewards.math_task import make_problem
    from rollout.engine import _ProcessStateGuard

    model_dir = quick_sft_model(MODELS)
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    prompts = [chat_prompt(tok, make_problem(rng)["question"]) for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, seed=0)
    outs = {}
    for name, extra in (("native", {}), ("emulated", vb.engine_kwargs())):
        with _ProcessStateGuard():
            llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                      kv_cache_memory_bytes=16 << 20, enable_chunked_prefill=False, seed=0, **extra)
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs[name] = [(list(r.outputs[0].token_ids),
                       [next(iter(d.values())).logprob for d in r.outputs[0].logprobs]) for r in res]
        del llm
    same = sum(a[0] == b[0] for a, b in zip(outs["native"], outs["emulated"], strict=True))
    assert same >= 6, f"only {same}/8 greedy generations agree"
    diffs = []
    for (ta, la), (tb, lb) in zip(outs["native"], outs["emulated"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        diffs += [abs(x - y) for x, y in zip(la[:n], lb[:n], strict=False)]
    assert diffs and max(diffs) < 0.05, max(diffs)


def test_rollout_worker_picks_bf16_emulation_from_its_cpu(tmp_path):
    """RolloutWorker: bf16_mode=auto follows the worker's CPU (native BF16 units -> native, else emulated); emulated
    puts every decoder linear on bf16_emulated; FP8 engines report 'off'."""
    from configs.schema import standalone_engine_config
    from diagnostics.mismatch import quick_sft_model
    from fp8core.cpu import cpu_caps
    from rollout.engine import RolloutWorker
    from rollout.vllm_bf16 import Bf16EmulatedLinearMethod

    model_dir = quick_sft_model(MODELS)
    w = RolloutWorker(model_dir, standalone_engine_config(bf16_mode="emulated", kv_cache_memory_bytes=16 << 20,
                                               max_model_len=256), run_dir=tmp_path)
    try:
        kinds = w.llm.apply_model(lambda m: sorted({type(mod.quant_method).__name__ for name, mod in
                                                    m.named_modules() if name.endswith(("qkv_proj", "down_proj"))}))[0]
        assert w.stats()["bf16_mode"] == "emulated" and kinds == [Bf16EmulatedLinearMethod.__name__]
        out = w.generate(["1 + 1 ="], n=2, max_tokens=8, seed=0)
        assert all(s["token_ids"] for s in out[0]["samples"])
    finally:
        w.shutdown()
    assert standalone_engine_config(bf16_mode="auto").policy.generation.vllm_cfg.bf16_mode == "auto"
    with pytest.raises(ValueError, match="vllm_cfg.bf16_mode: must be one of .*'fast'"):
        standalone_engine_config(bf16_mode="fast")
    from fp8core.bf16 import resolve_bf16_mode

    expected = resolve_bf16_mode("auto", device=torch.device("cpu"), native_bf16=cpu_caps().native_bf16)
    assert expected == ("native" if cpu_caps().native_bf16 else "emulated")
