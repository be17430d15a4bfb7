"""The embedded model's size keys reach TinyModelSpec (``model_spec``) and name its own cache directories
(``model_stem``): the built-in size keeps today's spec and directory names, another size never shares them."""
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from configs.schema import TINY_MODEL_SIZE, load_config
from embedded import bootstrap
from embedded.bootstrap import SFTConfig, ensure_default_assets, model_spec, model_stem
from embedded.tiny_model import TINY_MOE, TinyModelSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# ~3.6x the built-in model's parameters (10.5M vs 2.9M): twice the width and MLP width, head size 128
LARGER = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 1024}


def test_schema_defaults_are_the_builtin_spec():
    """configs cannot import embedded, so it repeats the built-in size; the two must not drift apart."""
    spec_fields = {f.name for f in fields(TinyModelSpec)}
    assert set(TINY_MODEL_SIZE) <= spec_fields
    for key, value in TINY_MODEL_SIZE.items():
        assert getattr(TINY_MOE if key.startswith(("num_experts", "moe_")) else TinyModelSpec(), key) == value, key


def test_no_size_keys_give_todays_spec_and_directories():
    assert model_spec("dense") == model_spec("dense", {}) == TinyModelSpec()
    assert model_spec("moe") == TINY_MOE
    assert (model_stem(TinyModelSpec()), model_stem(TINY_MOE)) == ("tiny-qwen3", "tiny-qwen3-moe")
    cfg = load_config(CONFIGS / "tiny_bf16.yaml")
    assert model_spec(cfg.bootstrap.model, cfg.bootstrap.model_size()).key() == TinyModelSpec().key()  # same marker


def test_size_keys_map_onto_the_spec_and_its_own_directories():
    spec = model_spec("dense", {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                                "num_key_value_heads": 4, "intermediate_size": 1024})
    assert (spec.hidden_size, spec.num_hidden_layers, spec.num_attention_heads, spec.num_key_value_heads,
            spec.intermediate_size, spec.head_dim, spec.num_experts) == (512, 8, 8, 4, 1024, 64, 0)
    assert model_stem(spec) == "tiny-qwen3-h512-l8-a8-kv4-i1024"
    assert model_spec("dense", {"hidden_size": 512}).head_dim == 128  # the head size follows hidden / heads
    moe = model_spec("moe", {"num_experts": 16, "num_experts_per_tok": 4})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (16, 4, 128)
    assert model_stem(moe) == "tiny-qwen3-moe-h256-l4-a4-kv2-i512-e16-k4-m128"
    # every size field is in the name: two sizes that differ in one field never share a directory
    stems = {model_stem(model_spec("dense", {key: 2 * value})) for key, value in TINY_MODEL_SIZE.items()
             if key in bootstrap.SIZE_TAGS}
    assert len(stems) == len(bootstrap.SIZE_TAGS) and "tiny-qwen3" not in stems
    with pytest.raises(ValueError, match="bootstrap.num_attention_heads"):
        model_spec("dense", {"num_attention_heads": 3, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="bootstrap.model"):
        model_spec("huge")


def test_a_sized_model_builds_beside_the_default_one(tmp_path, monkeypatch):
    """ensure_default_assets puts the base and SFT models of another size in their own directories and the default
    ones where they always were (the builds are stubbed: only the directories they are asked for are recorded)."""
    built = []
    monkeypatch.setattr(bootstrap, "build_tiny_model", lambda out, spec: built.append(out) or out)
    monkeypatch.setattr(bootstrap, "sft_bootstrap", lambda base, data, out, *a, **k: built.append(out) or out)
    kw = dict(task="arithmetic", n_train=8, n_validation=4, sft=SFTConfig(steps=1), log=lambda *_: None)
    default = ensure_default_assets(tmp_path, **kw)
    larger = ensure_default_assets(tmp_path, spec=model_spec("dense", LARGER), **kw)
    assert (default["base_model_dir"], default["model_dir"]) == (tmp_path / "tiny-qwen3-base", tmp_path / "tiny-qwen3-sft")
    stem = "tiny-qwen3-h512-l4-a4-kv2-i1024"
    assert (larger["base_model_dir"], larger["model_dir"]) == (tmp_path / f"{stem}-base", tmp_path / f"{stem}-sft")
    assert built == [default["base_model_dir"], default["model_dir"], larger["base_model_dir"], larger["model_dir"]]
    assert default["train"] == larger["train"]  # one data set serves every size


def test_the_bootstrap_flow_hands_the_size_keys_on(monkeypatch):
    """flows/bootstrap.py's task builds the spec of ``bootstrap.model`` at the size keys it is given."""
    from flows.bootstrap import ensure_assets

    seen = {}
    monkeypatch.setattr(bootstrap, "ensure_default_assets", lambda root, **kw: seen.update(kw) or {"model_dir": root})
    ensure_assets.fn("assets", None, 0, "addition", "moe", {"num_experts": 4})
    assert seen["spec"] == model_spec("moe", {"num_experts": 4}) and seen["spec"].num_experts == 4
    ensure_assets.fn("assets", None, 0, "addition")
    assert seen["spec"] == TinyModelSpec()


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
def test_a_larger_model_builds_loads_and_its_warm_start_trains(tmp_path):
    """The recipe's size keys -> a ~3.6x larger model in its own directories, loaded by transformers with FP8
    shapes, and a short SFT whose loss falls."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from embedded.tiny_model import qwen3_config

    cfg = load_config(CONFIGS / "tiny_bf16.yaml", [f"bootstrap.{k}={v}" for k, v in LARGER.items()])
    spec = model_spec(cfg.bootstrap.model, cfg.bootstrap.model_size())
    lines = []
    assets = ensure_default_assets(tmp_path, task="addition", spec=spec, n_train=64, n_validation=8, n_sft=256,
                                   sft=SFTConfig(steps=6, batch_size=4, warmup_steps=1), log=lines.append)
    assert assets["base_model_dir"].name == "tiny-qwen3-h512-l4-a4-kv2-i1024-base"
    assert assets["model_dir"].name == "tiny-qwen3-h512-l4-a4-kv2-i1024-sft-seed0"
    assert not (tmp_path / "addition" / "tiny-qwen3-base").exists()
    model = AutoModelForCausalLM.from_pretrained(assets["model_dir"])
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.intermediate_size,
            model.config.head_dim) == (512, 4, 1024, 128)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            assert mod.in_features % 128 == 0 and mod.out_features % 64 == 0, name
    with torch.device("meta"):  # the built-in model's count, without building it
        builtin = _count(Qwen3ForCausalLM(qwen3_config(TinyModelSpec(), _tokenizer(assets["model_dir"]))))
    assert _count(model) > 3 * builtin, (_count(model), builtin)
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", "\n".join(lines))]
    assert len(losses) == 2 and losses[1] < 0.8 * losses[0], lines  # first and last step's loss
    assert json.loads((assets["model_dir"] / ".complete").read_text())["base"] == spec.key()
