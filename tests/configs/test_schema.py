"""The recipe schema: shipped recipes load, seed key names work, bad input is rejected with its dotted path."""
from pathlib import Path

import pytest

from configs.schema import Config, ConfigError, config_from_dict, flatten, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["tiny_bf16", "tiny_fp8_rollout", "tiny_fp8_e2e", "tiny_fp8_e2e_kv", "tiny_fp8_tensorwise_cc", "tiny_moe_bf16",
        "tiny_moe_fp8_e2e", "tiny_mxfp8_e2e"]


@pytest.mark.parametrize("name", TINY)
def test_tiny_recipes_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.recipe == name
    assert cfg.run_dir == f"runs/{name}"
    assert cfg.policy.model_name == "embedded"


def test_recipe_semantics():
    bf16 = load_config(CONFIGS / "tiny_bf16.yaml")
    e2e = load_config(CONFIGS / "tiny_fp8_e2e.yaml")
    kv = load_config(CONFIGS / "tiny_fp8_e2e_kv.yaml")
    cc = load_config(CONFIGS / "tiny_fp8_tensorwise_cc.yaml")
    ro = load_config(CONFIGS / "tiny_fp8_rollout.yaml")
    assert (bf16.precision_tag, ro.precision_tag, e2e.precision_tag, kv.precision_tag) == (
        "bf16", "fp8-rollout", "fp8-e2e", "fp8-e2e-kvfp8")
    assert e2e.policy.megatron_cfg.fp8_cfg.fp8_recipe == "blockwise"
    assert cc.policy.megatron_cfg.fp8_cfg.fp8_recipe == "tensorwise" and cc.calibration.calibrated_clipping
    moe, moe8 = load_config(CONFIGS / "tiny_moe_bf16.yaml"), load_config(CONFIGS / "tiny_moe_fp8_e2e.yaml")
    assert (bf16.bootstrap.model, moe.bootstrap.model, moe8.bootstrap.model) == ("dense", "moe", "moe")
    assert (moe.precision_tag, moe8.precision_tag) == ("bf16", "fp8-e2e")
    assert moe8.trainer_fp8_spec() == e2e.trainer_fp8_spec() and moe8.loss_fn == e2e.loss_fn
    with pytest.raises(ConfigError, match="bootstrap.model"):
        load_config(CONFIGS / "tiny_moe_bf16.yaml", ["bootstrap.model=sparse"])
    # Same seed, steps and batch across the tiny family (fair comparisons).
    for c in (e2e, kv, cc, ro, moe, moe8):
        assert (c.grpo, c.policy.optimizer) == (bf16.grpo, bf16.policy.optimizer)


@pytest.mark.parametrize("name", ["llama3.1-8b-instruct-fp8-e2e", "qwen3-8b-base-fp8-e2e", "qwen3-30b-a3b-fp8-e2e"])
def test_gpu_recipes_validate(name):
    cfg = load_config(CONFIGS / "gpu" / f"{name}.yaml")
    vc = cfg.policy.generation.vllm_cfg
    assert vc.precision == "fp8" and cfg.policy.megatron_cfg.fp8_cfg.fp8 == "e4m3"
    assert cfg.policy.megatron_cfg.fp8_cfg.fp8_recipe == "blockwise"
    assert cfg.cluster.gpus_per_node == 8 and cfg.checkpointing.checkpoint_dir.startswith("s3://")
    assert (cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt) % cfg.policy.train_global_batch_size == 0
    # the layouts the recipes state (bench.layouts predicts their trainer memory): 8B, 4 engines + 4 sharded trainers
    # on one 8-GPU node; 30B-A3B, 8 + 8 on two nodes, trainers with activation checkpointing
    c, r = cfg.cluster, cfg.ray
    n = 8 if name.startswith("qwen3-30b-a3b") else 4
    assert (c.rollout_workers, c.policy_workers, r.rollout_worker.num_gpus, r.policy_worker.num_gpus) == (n, n, 1, 1)
    assert c.rollout_workers * r.rollout_worker.num_gpus + c.policy_workers * r.policy_worker.num_gpus == 2 * n
    assert c.num_nodes * c.gpus_per_node == 2 * n and (c.num_nodes == 1 or r.address)
    assert cfg.policy.megatron_cfg.activation_checkpointing  # every GPU recipe's trainers need it (bench.layouts)
    if name.startswith("qwen3-8b"):
        assert vc.kv_cache_dtype == "fp8" and cfg.policy.model_name == "Qwen/Qwen3-8B-Base"
    if name.startswith("qwen3-30b-a3b"):  # MoE: experts FP8 on both sides, routing replay on
        assert cfg.policy.model_name == "Qwen/Qwen3-30B-A3B-Base" and cfg.policy.router_replay.enabled
        assert vc.kv_cache_dtype == "fp8" and cfg.trainer_fp8_spec().forward_key() == cfg.rollout_fp8_spec().forward_key()


def test_seed_key_names_as_overrides():
    cfg = load_config(CONFIGS / "tiny_bf16.yaml", [
        "policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
        "policy.generation.vllm_cfg.num_first_layers_in_bf16=1", "policy.generation.vllm_cfg.num_last_layers_in_bf16=1",
        "policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
        "policy.generation.vllm_cfg.pow2_activation_scaling_factors=true",
        "policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.fp8=hybrid",
        "policy.megatron_cfg.fp8_cfg.fp8_recipe=rowwise", "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16=1",
        "policy.megatron_cfg.fp8_cfg.num_last_layers_in_bf16=1",
        "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true",
        "policy.megatron_cfg.fp8_cfg.pow2_activation_scaling_factors=true",
        "loss_fn.ratio_clip_max=0.3", "grpo.max_num_steps=2",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=32",
        "grpo.val_period=1",
        "checkpointing.save_period=1", "logger.mlflow.experiment_name=x", "ray.address=auto", "optimizer_unused_ok=1",
    ][:-1])
    vc = cfg.policy.generation.vllm_cfg
    assert (vc.precision, vc.kv_cache_dtype, vc.num_first_layers_in_bf16, vc.pow2_weight_scaling_factors) == (
        "fp8", "fp8", 1, True)
    assert cfg.policy.megatron_cfg.fp8_cfg.fp8 == "hybrid" and cfg.loss_fn.ratio_clip_max == 0.3
    assert cfg.grpo.max_num_steps == 2 and cfg.ray.address == "auto" and cfg.logger.mlflow.experiment_name == "x"
    flat = cfg.flat()
    assert flat["policy.generation.vllm_cfg.kv_cache_dtype"] == "fp8" and flat["grpo.max_num_steps"] == 2


@pytest.mark.parametrize("override, path", [
    ("grpo.max_num_stepz=2", "grpo.max_num_stepz: unknown key"),
    ("policy.generation.vllm_cfg.kv_cache_dtyp=fp8", "policy.generation.vllm_cfg.kv_cache_dtyp: unknown key"),
    ("bogus=1", "bogus: unknown key"),
    ("grpo.max_num_steps=two", "grpo.max_num_steps: expected an integer"),
    ("grpo.max_num_steps=2.5", "grpo.max_num_steps: expected an integer"),
    ("grpo.val_at_start=1", "grpo.val_at_start: expected true/false"),
    ("policy.optimizer.lr=fast", "policy.optimizer.lr: expected a number"),
    ("policy.optimizer.betas=[0.9]", "policy.optimizer.betas: expected a list of 2"),
    ("policy.generation.vllm_cfg.precision=fp4", "policy.generation.vllm_cfg.precision: must be one of"),
    ("policy.megatron_cfg.fp8_cfg.fp8_recipe=delayed", "policy.megatron_cfg.fp8_cfg.fp8_recipe: must be one of"),
    ("grpo=3", "grpo: expected a mapping"),
    ("grpo.max_num_steps.x=3", "grpo.max_num_steps: is a value"),
])
def test_bad_overrides_name_their_path(override, path):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny_bf16.yaml", [override])
    assert str(e.value).startswith(path), str(e.value)


@pytest.mark.parametrize("overrides, path", [
    # FP8 KV cache whose scales are never calibrated: it would quantize with unit scales.
    (["policy.generation.vllm_cfg.kv_cache_dtype=fp8", "calibration.kv_scales_period=0"], "calibration.kv_scales_period"),
    (["policy.generation.vllm_cfg.num_last_layers_in_bf16=1"], "policy.generation.vllm_cfg.num_last_layers_in_bf16"),
    (["policy.megatron_cfg.fp8_cfg.fp8_recipe=rowwise"], "policy.megatron_cfg.fp8_cfg"),
    (["grpo.num_generations_per_prompt=1", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8"],
     "grpo.num_generations_per_prompt"),
    (["policy.train_global_batch_size=12"], "policy.train_global_batch_size"),
    (["policy.train_micro_batch_size=5"], "policy.train_micro_batch_size"),
    (["loss_fn.ratio_clip_min=1.5"], "loss_fn.ratio_clip_min"),
    (["loss_fn.reference_policy_kl_penalty=-0.01"], "loss_fn.reference_policy_kl_penalty"),
    (["policy.max_total_sequence_length=100"], "policy.max_total_sequence_length"),
    (["policy.generation.vllm_cfg.max_model_len=100"], "policy.generation.vllm_cfg.max_model_len"),
    (["checkpointing.enabled=false", "checkpointing.resume=true"], "checkpointing.resume"),
    (["policy.generation.temperature=0"], "policy.generation.temperature"),
    (["calibration.calibrated_clipping=true"], "calibration.calibrated_clipping"),  # needs FP8 training
    (["policy.megatron_cfg.fp8_cfg.enabled=true", "calibration.calibrated_clipping=true",
      "calibration.clip_low_range=[0.85, 0.9]"], "calibration.clip_low_range"),
    (["policy.megatron_cfg.fp8_cfg.enabled=true", "calibration.calibrated_clipping=true",
      "calibration.clip_init_high=2.5"], "calibration.clip_init_high"),
    (["policy.megatron_cfg.fp8_cfg.enabled=true", "calibration.calibrated_clipping=true",
      "calibration.clip_max_delta_low=0"], "calibration.clip_max_delta_low"),
    # mxfp8's scales are E8M0 powers of two: a recipe that turns them off is refused, on either side
    (["policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.fp8_recipe=mxfp8",
      "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true"],
     "policy.megatron_cfg.fp8_cfg.pow2_activation_scaling_factors"),
    (["policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.fp8_recipe=mxfp8"],
     "policy.generation.vllm_cfg.pow2_weight_scaling_factors"),
])
def test_impossible_combinations(overrides, path):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny_bf16.yaml", overrides)
    assert str(e.value).startswith(path + ":"), str(e.value)


def test_yaml_unknown_key_and_defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("grpo:\n  max_num_steps: 3\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\ngrpo:\n  val_period: 1\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.grpo.max_num_steps, cfg.grpo.val_period, cfg.recipe) == (3, 1, "child")
    (tmp_path / "typo.yaml").write_text("defaults: base.yaml\npolicy:\n  generation:\n    vllm_cfg:\n      precison: fp8\n")
    with pytest.raises(ConfigError, match=r"^policy\.generation\.vllm_cfg\.precison: unknown key"):
        load_config(tmp_path / "typo.yaml")
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(tmp_path / "child.yaml", ["grpo.max_num_steps"])


def test_round_trip_and_defaults():
    cfg = Config()
    assert config_from_dict(cfg.to_dict()) == cfg
    assert flatten({"a": {"b": 1}, "c": 2}) == {"a.b": 1, "c": 2}
    # Config is frozen.
    with pytest.raises(AttributeError):
        cfg.run_dir = "x"  # type: ignore[misc]


E2E = ["policy.generation.vllm_cfg.precision=fp8", "policy.megatron_cfg.fp8_cfg.enabled=true"]


@pytest.mark.parametrize("key, mine, theirs", [
    ("fp8_recipe", "blockwise", "rowwise"),
    ("num_first_layers_in_bf16", "1", "0"),
    ("num_last_layers_in_bf16", "0", "2"),
    ("pow2_weight_scaling_factors", "true", "false"),
    ("pow2_activation_scaling_factors", "false", "true"),
])
def test_end_to_end_rollout_and_trainer_fp8_must_agree(key, mine, theirs):
    """A rollout FP8 setting that disagrees with the trainer's fails at load, naming both keys."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny_bf16.yaml", [*E2E, f"policy.generation.vllm_cfg.{key}={mine}",
                                                 f"policy.megatron_cfg.fp8_cfg.{key}={theirs}"])
    msg = str(e.value)
    assert msg.startswith(f"policy.generation.vllm_cfg.{key}:") and f"policy.megatron_cfg.fp8_cfg.{key}=" in msg, msg


def test_rollout_fp8_spec_follows_the_trainer_or_its_own_keys():
    over = ["policy.megatron_cfg.fp8_cfg.fp8_recipe=rowwise", "policy.megatron_cfg.fp8_cfg.num_last_layers_in_bf16=1",
            "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors=true"]
    cfg = load_config(CONFIGS / "tiny_bf16.yaml", [*E2E, *over, "policy.generation.vllm_cfg.fp8_recipe=rowwise"])
    assert cfg.rollout_fp8_spec().forward_key() == cfg.trainer_fp8_spec().forward_key() == (
        "rowwise", True, False, 0, 1, "auto")
    # FP8 generation only (BF16 trainer): the rollout keys, unset ones at their defaults
    gen_only = load_config(CONFIGS / "tiny_bf16.yaml", ["policy.generation.vllm_cfg.precision=fp8",
                                                        "policy.generation.vllm_cfg.num_first_layers_in_bf16=1"])
    assert gen_only.trainer_fp8_spec() is None
    assert gen_only.rollout_fp8_spec().forward_key() == ("blockwise", False, False, 1, 0, "auto")
    assert load_config(CONFIGS / "tiny_bf16.yaml").rollout_fp8_spec() is None
    # every shipped FP8 recipe: the engine runs the trainer's numerics
    for path in CONFIGS.glob("*.yaml"):
        c = load_config(path)
        if c.trainer_fp8_spec() is not None and c.rollout_fp8_spec() is not None:
            assert c.rollout_fp8_spec().forward_key() == c.trainer_fp8_spec().forward_key(), path


def test_kv_rounding_in_trainer_needs_an_fp8_kv_cache():
    with pytest.raises(ConfigError, match="calibration.kv_rounding_in_trainer.*kv_cache_dtype=fp8"):
        config_from_dict({}, ["calibration.kv_rounding_in_trainer=true"])
    cfg = config_from_dict({}, ["calibration.kv_rounding_in_trainer=true", "policy.generation.vllm_cfg.kv_cache_dtype=fp8"])
    assert cfg.calibration.kv_rounding_in_trainer
