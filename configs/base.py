"""The schema's shared names: the error every check raises and the constants both the sections and the checks
across sections read (configs/sections.py, configs/validation.py)."""
from __future__ import annotations

EMBEDDED = "embedded"  # policy.model_name / data paths: use the project's tiny model and synthetic math task
DEFAULT_TASK = "addition"  # data.task when the recipe names none (the embedded tasks: rewards/registry.py)


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message starts with the dotted key path."""


def _check(cond: bool, path: str, msg: str):
    """Raise ConfigError(``path: msg``) unless ``cond``."""
    if not cond:
        raise ConfigError(f"{path}: {msg}")


# The embedded tiny model's size when no ``bootstrap`` size key is set: the values of embedded.tiny_model's
# TinyModelSpec (and TINY_MOE for the MoE keys), repeated here because configs sits below embedded and the checks of a
# partial override need them (tests/embedded/test_model_size.py keeps the two equal).
TINY_MODEL_SIZE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
MOE_SIZE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")

# The FP8 recipe's key names (policy.megatron_cfg.fp8_cfg.<key>, policy.generation.vllm_cfg.<key>, and the engine's
# HF quantization_config, rollout/vllm_fp8.py) -> the fp8core.spec.FP8Spec field each one sets.
FP8_RECIPE_KEYS = {"fp8_recipe": "recipe", "num_first_layers_in_bf16": "num_first_layers_in_bf16",
                   "num_last_layers_in_bf16": "num_last_layers_in_bf16",
                   "pow2_weight_scaling_factors": "pow2_weight", "pow2_activation_scaling_factors": "pow2_activation"}

# cluster.collective_timeout_s when null: CPU trainers (gloo) fail fast on a dead rank; GPU trainers (NCCL) wait
# while rank 0 does tens of seconds of CPU work between collectives (the refit's gather), so at least this much.
CPU_COLLECTIVE_TIMEOUT_S = 60.0
GPU_COLLECTIVE_TIMEOUT_S = 600.0


def collective_timeout_s(value: float | None, trainer_gpus: float) -> float:
    """The trainers' collective timeout: ``cluster.collective_timeout_s``, or its default for CPU / GPU trainers."""
    if value is not None:
        return float(value)
    return GPU_COLLECTIVE_TIMEOUT_S if trainer_gpus > 0 else CPU_COLLECTIVE_TIMEOUT_S
