"""Every schema key is honoured or rejected: a key-by-key table of the schema, each key with the file that reads it
and the expression that reads it there. Adding a key without a reader, or deleting the code that reads one, fails
here. Keys that the schema only accepts at one value (``reject``) are tested to fail with their dotted path."""
from pathlib import Path

import pytest

from configs.schema import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny_bf16.yaml"

# key -> (file that reads it, text that must appear in that file)
READERS = {
    "run_dir": ("flows/grpo.py", "cfg.run_dir"),
    "recipe": ("tasks/tracking.py", "cfg.recipe"),
    "policy.model_name": ("flows/grpo.py", "cfg.policy.model_name"),
    "policy.tokenizer_name": ("configs/validation.py", "p.tokenizer_name"),  # only null / = model_name (rejected else)
    "policy.model_revision": ("storage/hub.py", "revision=p.model_revision"),
    "policy.train_global_batch_size": ("trainer/train_step.py", ".train_global_batch_size"),
    "policy.train_micro_batch_size": ("trainer/policy.py", ".train_micro_batch_size"),
    "policy.logprob_batch_size": ("trainer/policy.py", ".logprob_batch_size"),
    "policy.max_total_sequence_length": ("configs/validation.py", "p.max_total_sequence_length"),  # checked at load
    "policy.precision": ("trainer/policy.py", "policy.precision"),
    "policy.bf16_mode": ("trainer/policy.py", "p.bf16_mode"),
    "policy.max_grad_norm": ("trainer/train_step.py", ".max_grad_norm"),
    "policy.optimizer.lr": ("trainer/policy.py", "o.lr"),
    "policy.optimizer.weight_decay": ("trainer/policy.py", "o.weight_decay"),
    "policy.optimizer.betas": ("trainer/policy.py", "o.betas"),
    "policy.optimizer.eps": ("trainer/policy.py", "o.eps"),
    "policy.scheduler.warmup_steps": ("trainer/policy.py", "s.warmup_steps"),
    "policy.scheduler.decay": ("trainer/policy.py", "s.decay"),
    "policy.scheduler.min_lr_ratio": ("trainer/policy.py", "s.min_lr_ratio"),
    "policy.megatron_cfg.enabled": ("configs/validation.py", "p.megatron_cfg.enabled"),  # only false
    "policy.megatron_cfg.activation_checkpointing": ("trainer/policy.py", "p.megatron_cfg.activation_checkpointing"),
    "policy.megatron_cfg.fp8_cfg.enabled": ("configs/sections.py", "f8.enabled"),
    "policy.megatron_cfg.fp8_cfg.fp8": ("configs/sections.py", "fmt=f8.fp8"),
    "policy.megatron_cfg.fp8_cfg.fp8_recipe": ("configs/sections.py", "getattr(f8, k) for k in FP8_RECIPE_KEYS"),
    "policy.megatron_cfg.fp8_cfg.fp8_param": ("configs/validation.py", "f8.fp8_param"),  # only false
    "policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16": ("configs/validation.py", "f8.num_first_layers_in_bf16"),
    "policy.megatron_cfg.fp8_cfg.num_last_layers_in_bf16": ("configs/validation.py", "f8.num_last_layers_in_bf16"),
    "policy.megatron_cfg.fp8_cfg.pow2_weight_scaling_factors": ("configs/sections.py", "getattr(f8, k) for k in FP8_RECIPE_KEYS"),
    "policy.megatron_cfg.fp8_cfg.pow2_activation_scaling_factors": (
        "configs/sections.py", "getattr(f8, k) for k in FP8_RECIPE_KEYS"),
    "policy.megatron_cfg.fp8_cfg.backend": ("configs/sections.py", "backend=f8.backend"),
    "policy.generation.backend": ("configs/sections.py", 'backend: Literal["vllm"]'),  # the only engine
    "policy.generation.max_new_tokens": ("tasks/rl.py", "gen.max_new_tokens"),
    "policy.generation.temperature": ("tasks/rl.py", "gen.temperature"),
    "policy.generation.top_p": ("tasks/rl.py", "gen.top_p"),
    "policy.generation.top_k": ("configs/validation.py", "p.generation.top_k"),  # only null / -1
    "policy.generation.vllm_cfg.precision": ("configs/sections.py", 'vc.precision != "fp8"'),
    "policy.generation.vllm_cfg.kv_cache_dtype": ("rollout/engine.py", "vc.kv_cache_dtype"),
    "policy.generation.vllm_cfg.kv_cache_impl": ("rollout/engine.py", "vc.kv_cache_impl"),
    "policy.generation.vllm_cfg.bf16_mode": ("rollout/engine.py", "vc.bf16_mode"),
    "policy.generation.vllm_cfg.fp8_recipe": ("configs/sections.py", "getattr(vc, k) for k in FP8_RECIPE_KEYS"),
    "policy.generation.vllm_cfg.num_first_layers_in_bf16": ("configs/sections.py", "getattr(vc, k) for k in FP8_RECIPE_KEYS"),
    "policy.generation.vllm_cfg.num_last_layers_in_bf16": ("configs/sections.py", "getattr(vc, k) for k in FP8_RECIPE_KEYS"),
    "policy.generation.vllm_cfg.pow2_weight_scaling_factors": ("configs/sections.py", "getattr(vc, k) for k in FP8_RECIPE_KEYS"),
    "policy.generation.vllm_cfg.pow2_activation_scaling_factors": ("configs/sections.py", "getattr(vc, k) for k in FP8_RECIPE_KEYS"),
    "policy.generation.vllm_cfg.max_model_len": ("rollout/engine.py", "vc.max_model_len"),
    "policy.generation.vllm_cfg.tensor_parallel_size": ("configs/validation.py", "vc.tensor_parallel_size"),  # only 1
    "policy.generation.vllm_cfg.gpu_memory_utilization": ("rollout/engine.py", "vc.gpu_memory_utilization"),
    "policy.generation.vllm_cfg.kv_cache_memory_bytes": ("rollout/engine.py", "vc.kv_cache_memory_bytes"),
    "policy.generation.vllm_cfg.enforce_eager": ("rollout/engine.py", "vc.enforce_eager"),
    "policy.generation.vllm_cfg.compile_backend": ("rollout/engine.py", "vc.compile_backend"),
    "policy.generation.vllm_cfg.refit_loader": ("rollout/engine.py", "vllm.refit_loader"),
    "policy.generation.vllm_cfg.attention_backend": ("rollout/engine.py", "vc.attention_backend"),
    "policy.generation.vllm_cfg.use_deep_gemm": ("configs/validation.py", "vc.use_deep_gemm"),  # only false
    "policy.generation.vllm_cfg.max_num_seqs": ("rollout/engine.py", "vc.max_num_seqs"),
    "policy.generation.vllm_cfg.max_num_batched_tokens": ("rollout/engine.py", "vc.max_num_batched_tokens"),
    "policy.generation.vllm_cfg.threads": ("cluster/runtime.py", "vllm_cfg.threads"),
    "policy.threads": ("cluster/runtime.py", "cfg.policy.threads"),
    "loss_fn.ratio_clip_min": ("trainer/policy.py", "lf.ratio_clip_min"),
    "loss_fn.ratio_clip_max": ("trainer/policy.py", "lf.ratio_clip_max"),
    "loss_fn.ratio_clip_c": ("trainer/train_step.py", "lf.ratio_clip_c"),
    "loss_fn.token_level_loss": ("trainer/train_step.py", "lf.token_level_loss"),
    "loss_fn.reference_policy_kl_penalty": ("trainer/train_step.py", "kl_coef=lf.reference_policy_kl_penalty"),
    "loss_fn.reference_policy_kl_type": ("trainer/train_step.py", "kl_type=lf.reference_policy_kl_type"),
    "loss_fn.kl_input_clamp_value": ("trainer/train_step.py", "kl_input_clamp=lf.kl_input_clamp_value"),
    "loss_fn.kl_output_clamp_value": ("trainer/train_step.py", "kl_output_clamp=lf.kl_output_clamp_value"),
    "loss_fn.old_logprobs": ("trainer/train_step.py", "lf.old_logprobs"),
    "loss_fn.use_importance_sampling_correction": ("trainer/train_step.py", "lf.use_importance_sampling_correction"),
    "loss_fn.importance_sampling": ("trainer/train_step.py", "lf.importance_sampling"),
    "loss_fn.is_truncation": ("trainer/train_step.py", "lf.is_truncation"),
    "loss_fn.is_mask_low": ("trainer/train_step.py", "lf.is_mask_low"),
    "loss_fn.is_mask_high": ("trainer/train_step.py", "lf.is_mask_high"),
    "grpo.num_prompts_per_step": ("flows/grpo.py", "cfg.grpo.num_prompts_per_step"),
    "grpo.num_generations_per_prompt": ("tasks/context.py", "cfg.grpo.num_generations_per_prompt"),
    "grpo.max_num_steps": ("flows/grpo.py", "cfg.grpo.max_num_steps"),
    "grpo.normalize_rewards": ("trainer/train_step.py", "g.normalize_rewards"),
    "grpo.use_leave_one_out_baseline": ("trainer/train_step.py", "g.use_leave_one_out_baseline"),
    "grpo.dynamic_sampling": ("trainer/train_step.py", "cfg.grpo.dynamic_sampling"),
    "grpo.val_period": ("flows/grpo.py", "cfg.grpo.val_period"),
    "grpo.val_at_start": ("flows/grpo.py", "cfg.grpo.val_at_start"),
    "grpo.max_val_samples": ("flows/grpo.py", "cfg.grpo.max_val_samples"),
    "grpo.val_batch_size": ("tasks/context.py", "cfg.grpo.val_batch_size"),
    "grpo.seed": ("flows/grpo.py", "cfg.grpo.seed"),
    "cluster.pin_cpus": ("cluster/runtime.py", "cfg.cluster.pin_cpus"),
    "loss_fn.sequence_level_importance_ratios": ("trainer/train_step.py", "lf.sequence_level_importance_ratios"),
    "grpo.async_grpo.enabled": ("flows/grpo.py", "if ag.enabled"),
    "grpo.async_grpo.max_trajectory_age_steps": ("flows/grpo.py", "ag.max_trajectory_age_steps"),
    "calibration.kv_scales_period": ("tasks/context.py", "cal.kv_scales_period"),
    "calibration.kv_calibration_samples": ("tasks/context.py", "cal.kv_calibration_samples"),
    "calibration.kv_rounding_in_trainer": ("trainer/policy.py", "cal.kv_rounding_in_trainer"),
    "calibration.calibrated_clipping": ("trainer/policy.py", "cal.calibrated_clipping"),
    # the calibration.clip_* keys reach Calibrated Clipping field for field (Config.calibrated_clipping_config())
    "calibration.clip_period": ("fp8core/rl/calibrated_clipping.py", "self.config.clip_period"),
    "calibration.clip_low_range": ("fp8core/rl/calibrated_clipping.py", "cfg.clip_low_range"),
    "calibration.clip_high_range": ("fp8core/rl/calibrated_clipping.py", "cfg.clip_high_range"),
    "calibration.clip_search_step": ("fp8core/rl/calibrated_clipping.py", "self.clip_search_step"),
    "calibration.clip_max_delta_low": ("fp8core/rl/calibrated_clipping.py", "cfg.clip_max_delta_low"),
    "calibration.clip_max_delta_high": ("fp8core/rl/calibrated_clipping.py", "cfg.clip_max_delta_high"),
    "calibration.clip_init_low": ("fp8core/rl/calibrated_clipping.py", "config.clip_init_low"),
    "calibration.clip_init_high": ("fp8core/rl/calibrated_clipping.py", "config.clip_init_high"),
    "data.task": ("data/loading.py", "data_cfg.task"),
    "data.train_path": ("flows/grpo.py", "cfg.data.train_path"),
    "data.validation_path": ("flows/grpo.py", "cfg.data.validation_path"),
    "data.train_split": ("data/loading.py", "split=data_cfg.train_split"),
    "data.validation_split": ("data/loading.py", "split=data_cfg.validation_split"),
    "data.subset": ("data/loading.py", "subset=data_cfg.subset"),
    "data.question_key": ("data/loading.py", ".question_key"),
    "data.answer_key": ("data/loading.py", ".answer_key"),
    "data.max_input_seq_length": ("configs/validation.py", "c.data.max_input_seq_length"),  # checked at load
    "data.shuffle": ("data/loading.py", ".shuffle"),
    "data.s3_endpoint_url": ("data/loading.py", ".s3_endpoint_url"),
    "data.system_prompt": ("data/prompt.py", "data.system_prompt"),
    "data.system_prompt_file": ("data/prompt.py", "data.system_prompt_file"),
    "data.prompt_file": ("data/prompt.py", "data.prompt_file"),
    "checkpointing.enabled": ("flows/grpo.py", "ck.enabled"),
    "checkpointing.checkpoint_dir": ("flows/grpo.py", "ck.checkpoint_dir"),
    "checkpointing.save_period": ("flows/grpo.py", "ck_cfg.save_period"),
    "checkpointing.resume": ("flows/grpo.py", "ck_cfg.resume"),
    "checkpointing.keep_last_k": ("tasks/context.py", "ck.keep_last_k"),
    "checkpointing.s3_endpoint_url": ("flows/grpo.py", "ck_cfg.s3_endpoint_url"),
    "logger.mlflow_enabled": ("flows/grpo.py", "cfg.logger.mlflow_enabled"),
    "logger.mlflow.experiment_name": ("tasks/tracking.py", "cfg.logger.mlflow.experiment_name"),
    "logger.mlflow.run_name": ("tasks/tracking.py", "cfg.logger.mlflow.run_name"),
    "logger.mlflow.tracking_uri": ("tasks/tracking.py", "cfg.logger.mlflow.tracking_uri"),
    "logger.num_val_samples_to_print": ("flows/grpo.py", "cfg.logger.num_val_samples_to_print"),
    "logger.plot": ("flows/grpo.py", "cfg.logger.plot"),
    "evaluation.sets": ("flows/grpo.py", "cfg.evaluation.sets"),  # fields: tests/data/test_eval_sets.py
    "evaluation.num_samples": ("tasks/context.py", "ev.num_samples"),
    "evaluation.pass_k": ("tasks/context.py", "ev.pass_k"),
    "evaluation.sampled_max_prompts": ("tasks/context.py", "ev.sampled_max_prompts"),
    "evaluation.sampled_sets": ("tasks/context.py", "ev.sampled_sets"),
    "evaluation.sampled_when": ("flows/grpo.py", "cfg.evaluation.sampled_when"),
    "evaluation.bootstrap_samples": ("tasks/context.py", "ev.bootstrap_samples"),
    "testing.fault_val_accuracy_drop": ("process/faults.py", "val_accuracy_drop=t.fault_val_accuracy_drop"),  # TEST-ONLY
    "testing.fault_kill_rollout_at_step": ("process/faults.py", "kill_rollout_at_step=t.fault_kill_rollout_at_step"),  # TEST-ONLY
    "testing.fault_kill_policy_at_step": ("process/faults.py", "kill_policy_at_step=t.fault_kill_policy_at_step"),  # TEST-ONLY
    "testing.fault_skip_refit_at_step": ("process/faults.py", "skip_refit_at_step=t.fault_skip_refit_at_step"),  # TEST-ONLY
    "ray.address": ("cluster/runtime.py", "cfg.ray.address"),
    "ray.num_cpus": ("cluster/runtime.py", "cfg.ray.num_cpus"),
    "ray.auth_token_path": ("cluster/auth.py", "cfg.ray.auth_token_path"),
    "ray.policy_worker.num_cpus": ("cluster/runtime.py", "pw.num_cpus"),
    "ray.policy_worker.num_gpus": ("cluster/runtime.py", "pw.num_gpus"),
    "ray.rollout_worker.num_cpus": ("cluster/runtime.py", "rw.num_cpus"),
    "ray.rollout_worker.num_gpus": ("cluster/runtime.py", "rw.num_gpus"),
    "hub.allow_downloads": ("flows/grpo.py", "allow_downloads=cfg.hub.allow_downloads"),
    "cluster.num_nodes": ("configs/validation.py", "c.cluster.num_nodes"),  # consistency with ray.* checked at load
    "cluster.gpus_per_node": ("configs/validation.py", "c.cluster.gpus_per_node"),
    "cluster.rollout_workers": ("cluster/runtime.py", "cfg.cluster.rollout_workers"),
    "cluster.policy_workers": ("cluster/runtime.py", "cfg.cluster.policy_workers"),
    "cluster.collective_timeout_s": ("cluster/runtime.py", "cfg.cluster.collective_timeout_s"),
    "cluster.rollout_max_restarts": ("cluster/runtime.py", "cfg.cluster.rollout_max_restarts"),
    "cluster.placement_strategy": ("cluster/runtime.py", "cfg.cluster.placement_strategy"),
    "cluster.refit_transport": ("tasks/context.py", "refit_transport=cfg.cluster.refit_transport"),
    "bootstrap.assets_dir": ("flows/grpo.py", "cfg.bootstrap.assets_dir"),
    "bootstrap.sft_steps": ("flows/grpo.py", "cfg.bootstrap.sft_steps"),
    "bootstrap.sft_seed": ("configs/sections.py", "rl_seed if self.sft_seed is None else self.sft_seed"),
    "bootstrap.model": ("flows/grpo.py", "cfg.bootstrap.model"),
    # the size keys reach the flow as BootstrapCfg.model_size() (flows/grpo.py), applied by embedded.bootstrap.model_spec
    "bootstrap.hidden_size": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.num_hidden_layers": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.num_attention_heads": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.num_key_value_heads": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.intermediate_size": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.num_experts": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.num_experts_per_tok": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "bootstrap.moe_intermediate_size": ("configs/sections.py", "getattr(self, k) for k in TINY_MODEL_SIZE"),
    "policy.router_replay.enabled": ("trainer/policy.py", "p.router_replay.enabled"),
    "policy.sequence_packing.enabled": ("trainer/policy.py", "if sp.enabled"),
    "policy.sequence_packing.train_mb_tokens": ("trainer/policy.py", "sp.train_mb_tokens or"),
    "policy.sequence_packing.logprob_mb_tokens": ("trainer/policy.py", "sp.logprob_mb_tokens or"),
}

# keys accepted at one value only: (override that must fail, with this dotted path)
REJECTED = [
    ("policy.tokenizer_name=other/tok", "policy.tokenizer_name"),
    ("policy.megatron_cfg.enabled=true", "policy.megatron_cfg.enabled"),
    ("policy.megatron_cfg.fp8_cfg.enabled=true,policy.megatron_cfg.fp8_cfg.fp8_param=true",
     "policy.megatron_cfg.fp8_cfg.fp8_param"),
    ("policy.generation.backend=sglang", "policy.generation.backend"),
    ("policy.generation.top_k=20", "policy.generation.top_k"),
    ("policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.tensor_parallel_size"),
    ("policy.generation.vllm_cfg.use_deep_gemm=true", "policy.generation.vllm_cfg.use_deep_gemm"),
    ("loss_fn.reference_policy_kl_penalty=-0.1", "loss_fn.reference_policy_kl_penalty"),
    ("loss_fn.kl_output_clamp_value=0", "loss_fn.kl_output_clamp_value"),
    ("loss_fn.reference_policy_kl_type=k4", "loss_fn.reference_policy_kl_type"),
    ("cluster.num_nodes=2", "cluster.num_nodes"),
    ("ray.rollout_worker.num_gpus=1", "cluster.gpus_per_node"),
    ("cluster.policy_workers=0", "cluster.policy_workers"),
    ("cluster.rollout_workers=0", "cluster.rollout_workers"),
    ("cluster.rollout_max_restarts=-1", "cluster.rollout_max_restarts"),
    ("testing.fault_kill_rollout_at_step=99", "testing.fault_kill_rollout_at_step"),
    ("testing.fault_kill_policy_at_step=-1", "testing.fault_kill_policy_at_step"),
    ("testing.fault_skip_refit_at_step=99", "testing.fault_skip_refit_at_step"),
    ("cluster.refit_transport=nccl", "cluster.refit_transport"),
    ("cluster.placement_strategy=RANDOM", "cluster.placement_strategy"),
    ("ray.rollout_worker.num_cpus=0", "ray.rollout_worker.num_cpus"),
    ("grpo.async_grpo.max_trajectory_age_steps=0", "grpo.async_grpo.max_trajectory_age_steps"),
    ("grpo.async_grpo.enabled=true,loss_fn.use_importance_sampling_correction=false",
     "loss_fn.use_importance_sampling_correction"),
    ("grpo.async_grpo.enabled=true,loss_fn.old_logprobs=rollout,loss_fn.use_importance_sampling_correction=false",
     "loss_fn.old_logprobs"),
    ("cluster.pin_cpus=true,ray.address=auto", "cluster.pin_cpus"),
    ("loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss"),
]


def test_every_schema_key_has_a_reader():
    keys = set(Config().flat())
    assert sorted(keys - set(READERS)) == [], "schema keys without a reader in the table"
    assert sorted(set(READERS) - keys) == [], "table rows for keys the schema does not have"
    for key, (path, text) in READERS.items():
        assert text in (ROOT / path).read_text(), f"{key}: {path} no longer contains {text!r}"


@pytest.mark.parametrize("override, path", REJECTED)
def test_single_value_keys_reject_other_values(override, path):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, override.split(","))
    assert str(e.value).startswith(path + ":"), str(e.value)
