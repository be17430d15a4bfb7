"""FP8 checkpoint export: a pipeline checkpoint (PolicyWorker.save_checkpoint with the run's rollout FP8 spec) ->
``python -m tools.fp8_export export`` -> an HF directory that the CPU rollout engine loads through the fp8core method
with no refit, generating the same tokens and logprobs as an engine refit from the trainer; the vLLM-native
block-FP8 layout passes vLLM's own Fp8Config parsing and layer mapping."""
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from configs.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"

pytestmark = pytest.mark.slow  # vLLM engines


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of an FP8 policy whose masters are off the BF16 grid (as after training)."""
    from diagnostics.mismatch import quick_sft_model
    from trainer.policy import PolicyWorker

    model_dir = quick_sft_model(MODELS)
    tmp = tmp_path_factory.mktemp("export")
    cfg = load_config(ROOT / "configs" / "tiny_fp8_e2e.yaml", [
        "policy.precision=float32", "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16=1",
        "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true",
        "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", f"run_dir={tmp / 'run'}"])
    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3 * p.std().clamp_min(1e-3))
    uri = policy.save_checkpoint(str(tmp / "ck"), 5, extra={"rollout_fp8_spec": asdict(cfg.rollout_fp8_spec())})
    return {"cfg": cfg, "policy": policy, "model_dir": model_dir, "uri": uri, "tmp": tmp}


def _generate(model_dir, cfg, run_dir, weights=None):
    import random

    from embedded.tiny_model import chat_prompt
    from rewards.math_task import make_problem
    from rollout.engine import RolloutWorker

    engine = RolloutWorker(model_dir, cfg, run_dir=run_dir)
    try:
        if weights is not None:
            engine.refit(weights)
        rng = random.Random(1)
        prompts = [chat_prompt(engine.tokenizer, make_problem(rng)["question"]) for _ in range(4)]
        return engine.generate(prompts, n=2, max_tokens=16, temperature=1.0, seed=3)
    finally:
        engine.shutdown()


def test_export_round_trips_through_the_engine_without_refit(trained):
    from tools.fp8_export import main

    out = trained["tmp"] / "fp8-export"
    assert main(["export", trained["uri"], str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8core"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16  # BF16 first layer
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" in names
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in names
    refit = _generate(trained["model_dir"], trained["cfg"], trained["tmp"] / "e1", trained["policy"].weights())
    loaded = _generate(out, trained["cfg"], trained["tmp"] / "e2")
    assert [[s["token_ids"] for s in r["samples"]] for r in loaded] == \
        [[s["token_ids"] for s in r["samples"]] for r in refit]
    assert [[s["logprobs"] for s in r["samples"]] for r in loaded] == \
        [[s["logprobs"] for s in r["samples"]] for r in refit]


def test_vllm_native_layout_parses_with_vllms_fp8config(trained):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    from tools.fp8_export import export

    out = export(trained["uri"], trained["tmp"] / "native", layout="vllm")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fc = Fp8Config.from_config(qc)
    assert fc.is_checkpoint_fp8_serialized and fc.weight_block_size == [128, 128]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for i in range(4):
        for prefix in (f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.mlp.down_proj"):
            assert is_layer_skipped(prefix, fc.ignored_layers, fused_mapping=packed) == (i == 0), prefix
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.2.mlp.gate_proj.weight")
        s = f.get_tensor("model.layers.2.mlp.gate_proj.weight_scale_inv")
    assert w.dtype == torch.float8_e4m3fn and s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))


def test_export_bad_input_names_it(trained, tmp_path, capsys):
    from tools.fp8_export import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", trained["uri"], str(tmp_path / "full")]) == 2
    assert "OUT" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    from fp8core.spec import FP8Spec
    from tools.fp8_export import quantization_config

    with pytest.raises(ValueError, match="rowwise"):
        quantization_config(FP8Spec(recipe="rowwise"), 4, "vllm")


def test_export_eval_reports_parity_with_the_checkpoints_policy(trained, tmp_path, capsys):
    """``export --eval``: the engine serving the export (no refit) and the engine refit from the checkpoint's own
    policy answer the same validation prompts identically, and the export's tensors equal the trainer's served FP8
    weights (largest difference 0)."""
    import random

    from rewards.math_task import make_problem
    from tools.fp8_export import main

    rng = random.Random(5)
    data = tmp_path / "validation.jsonl"
    data.write_text("".join(json.dumps({"question": p["question"], "answer": str(p["answer"])}) + "\n"
                            for p in (make_problem(rng) for _ in range(6))))
    overrides = ["policy.precision=float32", "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16=1",
                 "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true",
                 "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", "policy.generation.max_new_tokens=16",
                 f"run_dir={tmp_path / 'run'}"]
    out = tmp_path / "export"
    rc = main(["export", trained["uri"], str(out), *overrides, "--recipe", str(ROOT / "configs" / "tiny_fp8_e2e.yaml"),
               "--eval", "--eval-data", str(data), "--eval-prompts", "6"])
    text = capsys.readouterr().out
    assert rc == 0, text
    line = next(ln for ln in text.splitlines() if ln.startswith("export parity on 6 validation prompts"))
    assert "identical responses 100.0%" in line and "largest weight difference 0 " in line + " ", line
    assert "export - policy +0.000 [+0.000, +0.000]" in line, line


def test_export_eval_vllm_layout_loads_through_transformers(trained, tmp_path, capsys):
    """``export --layout vllm --eval``: Hugging Face transformers' fine-grained FP8 loader (a loader the project did
    not write) reads the vLLM-native export; on a CPU it dequantizes to BF16, and those weights are exactly the
    trainer's FP8 codes times scales (no tensor missing or extra), and it answers the validation prompts beside the
    checkpoint's policy."""
    import random

    from rewards.math_task import make_problem
    from tools.fp8_export import main

    rng = random.Random(5)
    data = tmp_path / "validation.jsonl"
    data.write_text("".join(json.dumps({"question": p["question"], "answer": str(p["answer"])}) + "\n"
                            for p in (make_problem(rng) for _ in range(6))))
    overrides = ["policy.precision=float32", "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16=1",
                 "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true",
                 "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", "policy.generation.max_new_tokens=16",
                 f"run_dir={tmp_path / 'run'}"]
    out = tmp_path / "export"
    rc = main(["export", trained["uri"], str(out), *overrides, "--layout", "vllm", "--recipe",
               str(ROOT / "configs" / "tiny_fp8_e2e.yaml"), "--eval", "--eval-data", str(data), "--eval-prompts", "6"])
    text = capsys.readouterr().out
    assert rc == 0, text
    line = next(ln for ln in text.splitlines() if ln.startswith("export parity on 6 validation prompts"))
    assert "loaded by transformers" in line and "dequantized to BF16" in line, line
    # pow2 scales: an E4M3 code times a power of two is exact in BF16, so even before rounding nothing differs
    assert "largest weight difference 0 (0 in the loader's dtype)" in line, line
    assert "tensors in one only" not in line, line


def test_export_eval_needs_the_recipe(trained, tmp_path, capsys):
    from tools.fp8_export import main

    assert main(["export", trained["uri"], str(tmp_path / "o"), "--eval"]) == 2
    assert "--eval needs --recipe" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_export_eval_mxfp8_vllm_layout_loads_through_vllms_own_mxfp8_method(tmp_path, capsys):
    """``export --layout vllm --eval`` of an mxfp8 checkpoint: ModelOpt's MXFP8 layout (E4M3 codes, E8M0 scale bytes
    ``[N, K/32]``, BF16-kept layers and lm_head excluded), which vLLM's own ModelOpt MXFP8 config parses and its
    loader reads; on a CPU its emulation kernel holds each weight as codes x scale in BF16, which is exactly the
    trainer's codes x scales (E4M3 x a power of two fits BF16), and the export answers the validation prompts."""
    import random

    from safetensors import safe_open
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

    from diagnostics.mismatch import quick_sft_model
    from rewards.math_task import make_problem
    from tools.fp8_export import main
    from trainer.policy import PolicyWorker

    recipe = str(ROOT / "configs" / "tiny_mxfp8_e2e.yaml")
    overrides = ["policy.precision=float32", "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16=1",
                 "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", "policy.generation.max_new_tokens=16",
                 f"run_dir={tmp_path / 'run'}"]
    cfg = load_config(recipe, overrides)
    policy = PolicyWorker(quick_sft_model(MODELS), cfg, run_dir=cfg.run_dir)
    uri = policy.save_checkpoint(str(tmp_path / "ck"), 3, extra={"rollout_fp8_spec": asdict(cfg.rollout_fp8_spec())})
    rng = random.Random(5)
    data = tmp_path / "validation.jsonl"
    data.write_text("".join(json.dumps({"question": p["question"], "answer": str(p["answer"])}) + "\n"
                            for p in (make_problem(rng) for _ in range(6))))
    out = tmp_path / "export"
    rc = main(["export", uri, str(out), *overrides, "--layout", "vllm", "--recipe", recipe, "--eval", "--eval-data",
               str(data), "--eval-prompts", "6"])
    text, err = capsys.readouterr()
    assert rc == 0, text + err
    qc = ModelOptMxFp8Config.from_config(json.loads((out / "config.json").read_text())["quantization_config"])
    assert qc.get_name() == "modelopt_mxfp8"
    assert qc.is_layer_excluded("model.layers.0.self_attn.qkv_proj") and qc.is_layer_excluded("lm_head")
    assert not qc.is_layer_excluded("model.layers.1.mlp.gate_up_proj")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        w, s = f.get_tensor("model.layers.1.mlp.down_proj.weight"), f.get_tensor("model.layers.1.mlp.down_proj.weight_scale")
        assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in f.keys()
    q = policy.model.get_submodule("model.layers.1.mlp.down_proj").quantized_weight()
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (w.shape[0], w.shape[1] // 32)
    assert torch.equal(torch.exp2(s.float() - 127), q.scale)  # the E8M0 bytes are the trainer's scales
    line = next(ln for ln in text.splitlines() if ln.startswith("export parity on 6 validation prompts"))
    assert "ModelOpt MXFP8" in line and "emulation kernel" in line, line
    assert "largest weight difference 0 (0 in the loader's dtype)" in line, line
    assert "tensors in one only" not in line, line
