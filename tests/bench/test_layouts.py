"""bench.layouts: the GPU recipes' trainer memory predicted by trainer.memory_model, on the published model shapes."""
import json
from pathlib import Path

import pytest

from bench.layouts import SHAPES, main, predict
from trainer.memory_model import ModelShape

GPU = Path(__file__).resolve().parents[2] / "configs" / "gpu"
# the parameter counts the model cards publish
PUBLISHED = {"meta-llama/Llama-3.1-8B-Instruct": 8.03e9, "Qwen/Qwen3-8B-Base": 8.19e9, "Qwen/Qwen3-30B-A3B-Base": 30.5e9}


def test_shipped_shapes_have_the_published_parameter_counts():
    shapes = {k: v for k, v in json.loads(SHAPES.read_text()).items() if not k.startswith("_")}
    assert set(shapes) == set(PUBLISHED)
    for name, fields in shapes.items():
        assert ModelShape.from_config(fields).params == pytest.approx(PUBLISHED[name], rel=0.005), name


def test_the_30b_layout_fits_only_as_the_recipe_lays_it_out(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: the shipped shapes
    recipe = str(GPU / "qwen3-30b-a3b-fp8-e2e.yaml")
    r = predict(recipe, [], activation_checkpointing=True)
    assert r["world"] == 8 and r["source"] == "configs/gpu/model-shapes.json"
    assert r["masters"] == pytest.approx(4 * r["params"] / 8)
    assert r["total"] < 141e9 * 0.7  # room for the CUDA context, NCCL and fragmentation
    single_node = ["cluster.num_nodes=1", "ray.address=null", "cluster.policy_workers=4", "cluster.rollout_workers=4"]
    assert predict(recipe, single_node, activation_checkpointing=True)["total"] > 141e9


def test_command_prints_every_recipe_with_and_without_checkpointing(monkeypatch, tmp_path, capsys):
    """Trainer rows with and without checkpointing, fits on an H100 (80 GB) and an H200 (141 GB): as the recipes
    lay them out (checkpointing on) the 8B trainers fit both, the 30B's 8 ranks the H200 only; without checkpointing
    none fits an H100. Engine rows per GPU size: every recipe's engine fits both."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    recipes = sorted(GPU.glob("*.yaml"))
    assert main([str(p) for p in recipes] + ["--no-results-doc"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "fp8-e2e" in ln]
    n = len(recipes)  # two rows each: checkpointing on / off, two GPU sizes, two transports
    trainers, engines, refits = rows[:2 * n], rows[2 * n:4 * n], rows[4 * n:]
    assert len(trainers) == 2 * n and len(engines) == 2 * n and all(ln.endswith("| yes |") for ln in engines)
    # refit rows: per recipe the collective transport adds a fraction of a GB per trainer rank, the object store
    # the whole FP32 model on rank 0
    assert len(refits) == 2 * n and [("| collective |" in ln) for ln in refits] == [True, False] * n
    added = [float(ln.split("|")[7]) for ln in refits]
    assert all(c < 1.0 < o for c, o in zip(added[::2], added[1::2], strict=True))
    laid_out = [ln for ln in trainers if "| on |" in ln]
    assert [ln.endswith("| no | yes |") for ln in laid_out] == ["qwen3-30b" in ln for ln in laid_out]
    assert all(ln.endswith("| yes | yes |") for ln in laid_out if "qwen3-30b" not in ln)
    assert all("| no |" in ln for ln in trainers if "| off |" in ln)


def test_a_recipe_that_names_an_unknown_model_fails_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(SystemExit):
        main([str(GPU / "qwen3-8b-base-fp8-e2e.yaml"), "-o", "policy.model_name=org/unknown", "--no-results-doc"])
    err = capsys.readouterr().err
    assert "policy.model_name: 'org/unknown' is neither in the Hugging Face cache" in err


def test_refit_prediction_serves_what_the_trainer_serves():
    """predict_refit's served state S is the bytes of fp8core.serve's served state dict of a model of that shape
    (FP8 decoder linears with block scales, BF16 rest); its object-store trainer term holds the FP32 model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8core.convert import convert_to_fp8
    from fp8core.linear import FP8LinearConfig
    from fp8core.serve import served_state_dict
    from trainer.memory_model import predict_refit

    cfg = Qwen3Config(vocab_size=3000, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    convert_to_fp8(model, FP8LinearConfig(), num_first_layers_in_bf16=1)
    served = sum(t.numel() * t.element_size() for t in served_state_dict(model).values())
    shape = ModelShape.from_config(cfg.to_dict())
    r = predict_refit(shape, fp8_layers=2, engines=2, trainers=2)
    assert r["served"] == pytest.approx(served, rel=1e-6)
    assert r["moved_collective"] == 2 * r["served"] < r["moved_object_store"]
    assert r["trainer_object_store"] >= 4 * sum(p.numel() for p in model.parameters())
    assert r["largest_bucket"] == 2 * shape.vocab * shape.hidden  # the embeddings: larger than a layer here


def test_mxfp8_prediction_serves_e8m0_scales_and_the_engine_holds_fp32():
    """For mxfp8 the served state S is the bytes of the served state dict (E8M0 scales, one byte per 1x32 group),
    and the engine's weights hold those scales as FP32 (what its GEMMs read): 3 bytes more per 32 FP8 weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8core.convert import convert_to_fp8
    from fp8core.linear import FP8LinearConfig
    from fp8core.serve import served_state_dict
    from trainer.memory_model import predict_engine, predict_refit

    cfg = Qwen3Config(vocab_size=3000, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    convert_to_fp8(model, FP8LinearConfig(recipe="mxfp8", pow2_weight=True, pow2_activation=True),
                   num_first_layers_in_bf16=1)
    served = sum(t.numel() * t.element_size() for t in served_state_dict(model).values())
    shape = ModelShape.from_config(cfg.to_dict())
    assert predict_refit(shape, fp8_layers=2, engines=2, trainers=2, recipe="mxfp8")["served"] == \
        pytest.approx(served, rel=1e-6)
    fp8 = 2 * (shape.attention_params + shape.mlp_params)
    engine = predict_engine(shape, fp8_layers=2, kv_bytes_per_token=1, gpu_bytes=1e12, utilization=0.5,
                            recipe="mxfp8")
    assert engine["weights"] == pytest.approx(served + fp8 * 3 / 32, rel=1e-6)
