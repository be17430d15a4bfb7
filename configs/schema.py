"""The one schema for training recipes: frozen dataclasses + a loader for YAML files with dotted ``key=value`` overrides.

Key names follow the seed (NeMo RL's GRPO recipes) so its recipes read the same here:

- ``policy.generation.vllm_cfg.{precision, kv_cache_dtype, kv_cache_impl, num_first_layers_in_bf16,
  num_last_layers_in_bf16, pow2_weight_scaling_factors, pow2_activation_scaling_factors}``: the rollout engine (vLLM).
- ``policy.megatron_cfg.fp8_cfg.{enabled, fp8, fp8_recipe}``: the *trainer's* FP8 settings. We train with HF
  transformers + fp8core, not Megatron; the section keeps the seed's name so seed recipes load unchanged, and
  ``policy.megatron_cfg`` is documented as "the trainer section"; ``policy.megatron_cfg.activation_checkpointing``
  keeps its NeMo RL meaning (per decoder layer); its other Megatron-only keys are not accepted.
- ``loss_fn.*``, ``grpo.*``, ``checkpointing.*``, ``logger.mlflow.*`` as in the seed; ``data.*``, ``calibration.*``,
  ``ray.*``, ``cluster.*``, ``bootstrap.*``, ``hub.*`` and ``run_dir`` are ours.

Loading (``load_config``): the YAML may name a base recipe with ``defaults: other.yaml`` (path relative to the file);
the file is deep-merged over its base, then each override ``a.b.c=value`` (value parsed as YAML) is applied, then the
dict is converted to dataclasses. Unknown keys, wrong types and impossible combinations raise ``ConfigError`` whose
message starts with the dotted path of the offending key.
"""

from __future__ import annotations

# The schema is three modules; this one is the name the rest of the project imports.
from configs.loading import (
    apply_overrides,
    config_from_dict,
    deep_merge,
    load_config,
    parse_override,
    standalone_engine_config,
    to_yaml,
)
from configs.sections import *  # noqa: F403  the sections, Config, ConfigError and the constants
from configs.sections import __all__ as _sections
from configs.validation import embedded_set_digits, validate_config

__all__ = [*_sections, "apply_overrides", "config_from_dict", "deep_merge", "embedded_set_digits", "load_config",
           "parse_override", "standalone_engine_config", "to_yaml", "validate_config"]
