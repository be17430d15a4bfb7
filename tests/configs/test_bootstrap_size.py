"""The embedded model's size keys (``bootstrap.hidden_size`` ...): checked at load with a one-line message naming the
key, null by default (the built-in model), and handed on as ``BootstrapCfg.model_size()``."""
from pathlib import Path

import pytest

from configs.schema import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DENSE, MOE = CONFIGS / "tiny_bf16.yaml", CONFIGS / "tiny_moe_bf16.yaml"

BAD = [
    (DENSE, ["bootstrap.hidden_size=200"],
     "bootstrap.hidden_size: 200 is not a multiple of 128 (FP8 weight blocks are 128x128)"),
    (DENSE, ["bootstrap.intermediate_size=600"],
     "bootstrap.intermediate_size: 600 is not a multiple of 128 (FP8 weight blocks are 128x128)"),
    (MOE, ["bootstrap.moe_intermediate_size=96"],
     "bootstrap.moe_intermediate_size: 96 is not a multiple of 128 (FP8 weight blocks are 128x128)"),
    (DENSE, ["bootstrap.num_hidden_layers=0"], "bootstrap.num_hidden_layers: must be a positive integer, got 0"),
    (DENSE, ["bootstrap.hidden_size=-128"], "bootstrap.hidden_size: must be a positive integer, got -128"),
    (DENSE, ["bootstrap.num_key_value_heads=1.5"], "bootstrap.num_key_value_heads: expected an integer, got float 1.5"),
    (DENSE, ["bootstrap.num_attention_heads=3"],
     "bootstrap.num_attention_heads: 3 does not divide bootstrap.hidden_size 256"),
    (DENSE, ["bootstrap.num_key_value_heads=3"],
     "bootstrap.num_key_value_heads: 3 does not divide bootstrap.num_attention_heads 4"),
    (DENSE, ["bootstrap.num_attention_heads=16", "bootstrap.num_key_value_heads=4"],
     "bootstrap.num_attention_heads: head size 256 / 16 = 16 is not a multiple of 32 (vLLM's CPU attention and FP8 "
     "KV cache)"),
    (DENSE, ["bootstrap.hidden_size=384", "bootstrap.num_key_value_heads=1"],
     "bootstrap.num_key_value_heads: K/V projection width 1 x 96 = 96 is not a multiple of 64 (FP8 linears' output "
     "features)"),
    (DENSE, ["bootstrap.num_experts=4"], "bootstrap.num_experts: applies to bootstrap.model: moe only"),
    (MOE, ["bootstrap.num_experts=4", "bootstrap.num_experts_per_tok=5"],
     "bootstrap.num_experts_per_tok: must be in [2, num_experts=4], got 5"),
    (DENSE, ["policy.model_name=Qwen/Qwen3-0.6B", "bootstrap.hidden_size=512"],
     "bootstrap.hidden_size: sizes the embedded model only, but policy.model_name is 'Qwen/Qwen3-0.6B'"),
]


@pytest.mark.parametrize("recipe, overrides, message", BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_a_bad_size_is_rejected_at_load_naming_its_key(recipe, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(recipe, overrides)
    assert str(e.value) == message


def test_unset_size_keys_mean_the_builtin_model():
    for recipe in (DENSE, MOE):
        assert load_config(recipe).bootstrap.model_size() == {}


def test_set_size_keys_are_handed_on_by_field_name():
    dense = load_config(DENSE, ["bootstrap.hidden_size=512", "bootstrap.num_hidden_layers=8",
                                "bootstrap.intermediate_size=1024", "bootstrap.num_attention_heads=8",
                                "bootstrap.num_key_value_heads=4"])
    assert dense.bootstrap.model_size() == {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                                            "num_key_value_heads": 4, "intermediate_size": 1024}
    moe = load_config(MOE, ["bootstrap.num_experts=16", "bootstrap.num_experts_per_tok=4",
                            "bootstrap.moe_intermediate_size=256"])
    assert moe.bootstrap.model_size() == {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256}
