"""The GPU recipes name hub models (``Qwen/Qwen3-8B-Base``, ...): they load through the same path as a CPU run up to
the missing GPU -- the recipe, the hub name pinned in the Hugging Face cache, the rollout KV-cache check on the
snapshot's config.json -- and without the model in the cache the run stops before any work, in one line."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hub import add_snapshot  # noqa: E402

from cluster.runtime import check_rollout_kv  # noqa: E402
from configs.schema import ConfigError, load_config  # noqa: E402
from storage.hub import resolve_config  # noqa: E402

GPU = Path(__file__).resolve().parents[2] / "configs" / "gpu"
RECIPES = sorted(p.stem for p in GPU.glob("*.yaml"))
# the config.json fields the load-time checks read, at each model's real shape
SHAPES = {"Qwen/Qwen3-8B-Base": ("Qwen3ForCausalLM", 4096, 36, 32, 8),
          "Qwen/Qwen3-30B-A3B-Base": ("Qwen3MoeForCausalLM", 2048, 48, 32, 4),
          "meta-llama/Llama-3.1-8B-Instruct": ("LlamaForCausalLM", 4096, 32, 32, 8)}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_every_gpu_recipe_names_a_known_hub_model():
    assert RECIPES and {load_config(GPU / f"{r}.yaml").policy.model_name for r in RECIPES} <= set(SHAPES)


@pytest.mark.parametrize("name", RECIPES)
def test_gpu_recipe_resolves_its_hub_model_from_the_cache(hub, name):
    cfg = load_config(GPU / f"{name}.yaml")
    arch, hidden, layers, heads, kv = SHAPES[cfg.policy.model_name]
    config = {"architectures": [arch], "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128}
    rev = add_snapshot(hub, "model", cfg.policy.model_name, {"config.json": json.dumps(config).encode()})
    snap = resolve_config(cfg)["policy.model_name"]
    assert snap.commit == rev and snap.pinned == f"{cfg.policy.model_name}@{rev}"
    kv_mode, _ = check_rollout_kv(cfg, snap.path)  # the driver's last check before Ray and the GPU workers
    assert kv_mode.startswith("fp8") == cfg.policy.generation.vllm_cfg.kv_fp8


@pytest.mark.parametrize("name", RECIPES)
def test_gpu_recipe_without_its_model_stops_in_one_line(hub, name, capsys):
    from flows.grpo import main

    model = load_config(GPU / f"{name}.yaml").policy.model_name
    with pytest.raises(ConfigError) as e:
        resolve_config(load_config(GPU / f"{name}.yaml"))
    assert str(e.value) == (f"policy.model_name: hub model {model} (revision main) is not in the Hugging Face cache "
                            f"{hub} and downloads are off (set hub.allow_downloads=true to download it, or "
                            "HF_HUB_CACHE / HF_HOME to the cache that holds it)")
    assert main([str(GPU / f"{name}.yaml")]) == 2  # the command line: before Prefect, Ray or any download
    assert capsys.readouterr().err == f"config error: {e.value}\n"
