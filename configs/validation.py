"""The checks across keys and sections of a recipe, run when a ``Config`` is built (each function takes that
``configs.sections.Config``, not imported here: sections imports this module); the first that fails raises its
ConfigError, named by the dotted path of the key to change."""

from __future__ import annotations

import re

from configs.base import (
    EMBEDDED,
    FP8_RECIPE_KEYS,
    GPU_COLLECTIVE_TIMEOUT_S,
    MOE_SIZE_KEYS,
    TINY_MODEL_SIZE,
    _check,
)


def validate_config(c):
    """The checks across keys and sections, one section after the other; the first check that fails raises its
    ConfigError (named by the dotted path of the key to change)."""
    _validate_sizes(c)
    _validate_loss(c)
    _validate_optimizer_and_sampling(c)
    _validate_fp8(c)
    _validate_nemo_keys(c)
    _validate_cluster(c)
    _validate_kv_and_calibration(c)
    _validate_lengths(c)
    _validate_checkpointing(c)
    _check(bool(c.data.question_key) and bool(c.data.answer_key), "data.question_key", "column names must be non-empty")
    _validate_evaluation(c)
    _validate_model_size(c)


def _validate_sizes(c):
    """Counts and batch sizes: each at least 1, a group of >= 2 generations per prompt, batches that divide, and a
    validation period >= 0."""
    g, p = c.grpo, c.policy
    vc = p.generation.vllm_cfg
    for path, value in [("grpo.num_prompts_per_step", g.num_prompts_per_step), ("grpo.max_num_steps", g.max_num_steps),
                        ("policy.train_micro_batch_size", p.train_micro_batch_size),
                        ("policy.train_global_batch_size", p.train_global_batch_size),
                        ("policy.logprob_batch_size", p.logprob_batch_size),
                        ("policy.generation.max_new_tokens", p.generation.max_new_tokens),
                        ("grpo.max_val_samples", g.max_val_samples), ("grpo.val_batch_size", g.val_batch_size),
                        ("policy.threads", p.threads), ("policy.generation.vllm_cfg.threads", vc.threads)]:
        _check(value >= 1, path, f"must be >= 1, got {value}")
    _check(g.num_generations_per_prompt >= 2, "grpo.num_generations_per_prompt",
           f"GRPO needs >= 2 generations per prompt for a group baseline, got {g.num_generations_per_prompt}")
    batch = g.num_prompts_per_step * g.num_generations_per_prompt
    _check(batch % p.train_global_batch_size == 0, "policy.train_global_batch_size",
           f"{p.train_global_batch_size} must divide grpo.num_prompts_per_step * grpo.num_generations_per_prompt "
           f"= {batch}")
    _check(p.train_global_batch_size % p.train_micro_batch_size == 0, "policy.train_micro_batch_size",
           f"{p.train_micro_batch_size} must divide policy.train_global_batch_size = {p.train_global_batch_size}")
    _check(g.val_period >= 0, "grpo.val_period", f"must be >= 0 (0 = only at start/end), got {g.val_period}")


def _validate_loss(c):
    """The loss: clip bounds, the reference-policy KL term, one importance weight only, and the IS mask bounds."""
    lf = c.loss_fn
    _check(0.0 <= lf.ratio_clip_min < 1.0, "loss_fn.ratio_clip_min", f"must be in [0, 1), got {lf.ratio_clip_min}")
    _check(lf.ratio_clip_max >= 0.0, "loss_fn.ratio_clip_max", f"must be >= 0, got {lf.ratio_clip_max}")
    _check(lf.ratio_clip_c is None or lf.ratio_clip_c > 1.0, "loss_fn.ratio_clip_c",
           f"dual-clip bound must be > 1, got {lf.ratio_clip_c}")
    _check(lf.reference_policy_kl_penalty >= 0.0, "loss_fn.reference_policy_kl_penalty",
           f"must be >= 0 (0 = no reference-policy KL term), got {lf.reference_policy_kl_penalty}")
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        v = getattr(lf, key)
        _check(v is None or v > 0, f"loss_fn.{key}", f"must be > 0 or null (no clamp), got {v}")
    _check(lf.is_truncation > 0, "loss_fn.is_truncation", f"must be > 0, got {lf.is_truncation}")
    _check(not (lf.old_logprobs == "rollout" and lf.use_importance_sampling_correction),
           "loss_fn.use_importance_sampling_correction",
           "must be false with loss_fn.old_logprobs=rollout: the ratio pi_theta / pi_rollout already is the "
           "importance weight against the rollout engine (its clip truncates it); a second weight would count the "
           "mismatch twice")
    if lf.sequence_level_importance_ratios:
        _check(not lf.token_level_loss, "loss_fn.token_level_loss",
               "must be false with loss_fn.sequence_level_importance_ratios (GSPO averages each sequence's tokens, "
               "then the sequences)")
        _check(not c.calibration.calibrated_clipping, "calibration.calibrated_clipping",
               "matches token-level clip fractions; GSPO clips whole sequences: turn one of them off")
    ag = c.grpo.async_grpo
    _check(ag.max_trajectory_age_steps >= 1, "grpo.async_grpo.max_trajectory_age_steps",
           f"must be >= 1 (steps of rollouts generated ahead of training), got {ag.max_trajectory_age_steps}")
    if ag.enabled:  # the behaviour policy is k versions old: the ratio needs a proximal pi_old and an IS weight
        _check(lf.old_logprobs == "trainer", "loss_fn.old_logprobs",
               "must be trainer with grpo.async_grpo.enabled: the PPO ratio is taken against the trainer's policy "
               "before this step's update (the proximal policy) and the importance weight pi_old / pi_rollout "
               "corrects staleness and FP8 mismatch together; against the stale engine the clip would bound the "
               "drift of several updates")
        _check(lf.use_importance_sampling_correction, "loss_fn.use_importance_sampling_correction",
               "must be true with grpo.async_grpo.enabled: trajectories come from an older policy than the one "
               "being trained, so the loss needs the importance weight pi_old / pi_rollout")
    if lf.is_mask_low is not None and lf.is_mask_high is not None:
        _check(0 <= lf.is_mask_low < 1 < lf.is_mask_high, "loss_fn.is_mask_low",
               f"need 0 <= is_mask_low < 1 < is_mask_high, got [{lf.is_mask_low}, {lf.is_mask_high}]")


def _validate_optimizer_and_sampling(c):
    """The optimizer (gradient clip, learning rate, schedule floor) and the rollout sampling (temperature, top-p)."""
    p = c.policy
    _check(p.max_grad_norm > 0, "policy.max_grad_norm", f"must be > 0, got {p.max_grad_norm}")
    o = p.optimizer
    _check(o.lr > 0, "policy.optimizer.lr", f"must be > 0, got {o.lr}")
    _check(o.weight_decay >= 0, "policy.optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    for i, b in enumerate(o.betas):
        _check(0 <= b < 1, f"policy.optimizer.betas[{i}]", f"must be in [0, 1) (AdamW's moment decay), got {b}")
    _check(o.eps > 0, "policy.optimizer.eps", f"must be > 0 (AdamW divides by sqrt(v) + eps), got {o.eps}")
    _check(p.scheduler.warmup_steps >= 0, "policy.scheduler.warmup_steps",
           f"must be >= 0 (0 = no warmup), got {p.scheduler.warmup_steps}")
    _check(0.0 <= p.scheduler.min_lr_ratio <= 1.0, "policy.scheduler.min_lr_ratio", "must be in [0, 1]")
    _check(p.generation.temperature > 0, "policy.generation.temperature",
           "must be > 0 for RL rollouts (logprobs of greedy decoding are not a policy)")
    _check(0 < p.generation.top_p <= 1, "policy.generation.top_p", f"must be in (0, 1], got {p.generation.top_p}")


def _validate_fp8(c):
    """FP8 training and FP8 rollouts: BF16 layer counts >= 0, rollout FP8 keys only with FP8 rollouts (and, end to
    end, equal to the trainer's), no FP8 training settings with FP8 training off, no FP8 parameter storage."""
    p = c.policy
    vc, f8 = p.generation.vllm_cfg, p.megatron_cfg.fp8_cfg
    for path, v in [("policy.generation.vllm_cfg.num_first_layers_in_bf16", vc.num_first_layers_in_bf16),
                    ("policy.generation.vllm_cfg.num_last_layers_in_bf16", vc.num_last_layers_in_bf16),
                    ("policy.megatron_cfg.fp8_cfg.num_first_layers_in_bf16", f8.num_first_layers_in_bf16),
                    ("policy.megatron_cfg.fp8_cfg.num_last_layers_in_bf16", f8.num_last_layers_in_bf16)]:
        _check(v is None or v >= 0, path, f"must be >= 0, got {v}")
    # Impossible combinations -------------------------------------------------------------------------------------
    if vc.precision != "fp8":
        for key in FP8_RECIPE_KEYS:
            _check(getattr(vc, key) is None, f"policy.generation.vllm_cfg.{key}",
                   "only applies to FP8 rollouts: set policy.generation.vllm_cfg.precision=fp8 or leave it unset")
    elif f8.enabled:  # end-to-end FP8: one numerics on both sides
        for key in FP8_RECIPE_KEYS:
            mine, theirs = getattr(vc, key), getattr(f8, key)
            _check(mine is None or mine == theirs, f"policy.generation.vllm_cfg.{key}",
                   f"{mine!r} disagrees with policy.megatron_cfg.fp8_cfg.{key}={theirs!r}: end-to-end FP8 runs the "
                   "trainer's numerics in the engine (leave the rollout key unset to follow the trainer)")
    if not f8.enabled:
        _check(f8 == type(f8)(), "policy.megatron_cfg.fp8_cfg",
               "FP8 training settings given but policy.megatron_cfg.fp8_cfg.enabled is false")
    _check(not f8.fp8_param, "policy.megatron_cfg.fp8_cfg.fp8_param",
           "FP8 parameter storage is not supported (master weights stay BF16/FP32)")
    # mxfp8's scales are E8M0 powers of two, on the side whose keys set the recipe
    sides = [("policy.megatron_cfg.fp8_cfg", f8)] if f8.enabled else []
    sides += [("policy.generation.vllm_cfg", vc)] if vc.precision == "fp8" and not f8.enabled else []
    for prefix, keys in sides:
        if keys.fp8_recipe == "mxfp8":
            for key in ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors"):
                _check(bool(getattr(keys, key)), f"{prefix}.{key}",
                       "must be true with fp8_recipe mxfp8 (its scales are E8M0 powers of two)")


def _validate_nemo_keys(c):
    """Keys kept so NeMo RL recipes load: accepted only with the value that means what we do."""
    p = c.policy
    vc = p.generation.vllm_cfg
    _check(not p.megatron_cfg.enabled, "policy.megatron_cfg.enabled",
           "the trainer is Hugging Face transformers + fp8core, not Megatron-Core; set it to false (the "
           "policy.megatron_cfg.fp8_cfg section still configures our trainer's FP8)")
    _check(not vc.use_deep_gemm, "policy.generation.vllm_cfg.use_deep_gemm",
           "the fp8core vLLM method deliberately does not use DeepGEMM (its activation quantization is not the "
           "trainer's, so rollouts would lose bit-identity); set it to false")
    _check(vc.tensor_parallel_size == 1, "policy.generation.vllm_cfg.tensor_parallel_size",
           f"{vc.tensor_parallel_size}: one rollout engine runs on one device (tensor parallelism is not "
           "implemented); set it to 1")
    _check(p.generation.top_k in (None, -1), "policy.generation.top_k",
           f"{p.generation.top_k}: top-k sampling makes vLLM's logprobs those of a truncated distribution the "
           "trainer does not compute, so importance ratios would be biased; leave it null (or -1)")
    _check(p.tokenizer_name in (None, p.model_name), "policy.tokenizer_name",
           f"{p.tokenizer_name!r}: the tokenizer is loaded from the model directory (policy.model_name); a separate "
           "tokenizer is not supported, leave it null")


def _validate_cluster(c):
    """The cluster and the Ray workers: node and worker counts, the collective timeout, restarts, each worker's
    resources, and GPUs that fit the nodes."""
    _check(c.cluster.num_nodes >= 1 and c.cluster.gpus_per_node >= 0, "cluster.num_nodes",
           "num_nodes must be >= 1 and gpus_per_node >= 0")
    _check(c.cluster.num_nodes == 1 or c.ray.address is not None, "cluster.num_nodes",
           f"{c.cluster.num_nodes} nodes need an existing Ray cluster: set ray.address")
    _check(not c.cluster.pin_cpus or c.ray.address is None, "cluster.pin_cpus",
           "pins the workers to this machine's CPUs: a local Ray only (ray.address must be null)")
    _check(c.cluster.rollout_workers >= 1, "cluster.rollout_workers",
           f"must be >= 1 (the number of vLLM engines), got {c.cluster.rollout_workers}")
    _check(c.cluster.policy_workers >= 1, "cluster.policy_workers",
           f"must be >= 1 (the number of data-parallel trainers), got {c.cluster.policy_workers}")
    timeout = c.cluster.collective_timeout_s
    _check(timeout is None or 0 < timeout <= 3600, "cluster.collective_timeout_s",
           f"{timeout}: must be in (0, 3600] seconds (or null: 60 s on CPU trainers, 600 s on GPU trainers)")
    _check(timeout is None or timeout >= GPU_COLLECTIVE_TIMEOUT_S or c.ray.policy_worker.num_gpus == 0
           or c.cluster.policy_workers == 1, "cluster.collective_timeout_s",
           f"{timeout} s with GPU trainers (ray.policy_worker.num_gpus {c.ray.policy_worker.num_gpus}): NCCL's "
           f"collectives wait while rank 0 does tens of seconds of CPU work; use >= {GPU_COLLECTIVE_TIMEOUT_S:.0f} "
           "or null")
    _check(c.cluster.rollout_max_restarts >= 0, "cluster.rollout_max_restarts",
           f"must be >= 0 (0: a dead rollout engine fails the run), got {c.cluster.rollout_max_restarts}")
    for name, w in (("policy_worker", c.ray.policy_worker), ("rollout_worker", c.ray.rollout_worker)):
        _check(w.num_cpus >= 0 and w.num_gpus >= 0, f"ray.{name}.num_cpus", "resources must be >= 0")
        _check(w.num_cpus > 0 or w.num_gpus > 0, f"ray.{name}.num_cpus",
               "a worker needs CPUs or GPUs (its placement-group bundle cannot be empty)")
    gpus = (c.cluster.policy_workers * c.ray.policy_worker.num_gpus
            + c.cluster.rollout_workers * c.ray.rollout_worker.num_gpus)
    _check(gpus <= c.cluster.num_nodes * c.cluster.gpus_per_node, "cluster.gpus_per_node",
           f"cluster.policy_workers x ray.policy_worker.num_gpus + cluster.rollout_workers x "
           f"ray.rollout_worker.num_gpus = {gpus} exceed cluster.num_nodes * cluster.gpus_per_node = "
           f"{c.cluster.num_nodes * c.cluster.gpus_per_node}")


def _validate_kv_and_calibration(c):
    """The FP8 KV cache and the calibrations: calibrated K/V scales with an FP8 cache (and the KV-only keys only with
    one), and Calibrated Clipping (FP8 training only) with its period, search steps, ranges and starting bounds."""
    lf, cal = c.loss_fn, c.calibration
    vc, f8 = c.policy.generation.vllm_cfg, c.policy.megatron_cfg.fp8_cfg
    if not vc.kv_fp8:
        _check(vc.kv_cache_impl == "auto", "policy.generation.vllm_cfg.kv_cache_impl",
               f"{vc.kv_cache_impl} only applies with policy.generation.vllm_cfg.kv_cache_dtype=fp8")
    if vc.kv_fp8:
        _check(cal.kv_scales_period >= 1, "calibration.kv_scales_period",
               f"policy.generation.vllm_cfg.kv_cache_dtype={vc.kv_cache_dtype} needs calibrated K/V scales "
               "(period >= 1); with 0 the cache would quantize with unit scales")
        _check(cal.kv_calibration_samples >= 1, "calibration.kv_calibration_samples",
               "must be >= 1 with an FP8 KV cache")
    else:
        _check(not cal.kv_rounding_in_trainer, "calibration.kv_rounding_in_trainer",
               "replays the engine's FP8 KV cache: needs policy.generation.vllm_cfg.kv_cache_dtype=fp8")
    if cal.calibrated_clipping:
        _check(f8.enabled, "calibration.calibrated_clipping",
               "calibrates FP8 training against its BF16 shadow: needs policy.megatron_cfg.fp8_cfg.enabled=true")
        _check(cal.clip_period >= 1, "calibration.clip_period", f"must be >= 1, got {cal.clip_period}")
        for key in ("clip_search_step", "clip_max_delta_low", "clip_max_delta_high"):
            _check(getattr(cal, key) > 0, f"calibration.{key}", f"must be > 0, got {getattr(cal, key)}")
        lo, hi = cal.clip_low_range, cal.clip_high_range
        _check(0 < lo[0] <= 1 - lf.ratio_clip_min <= lo[1] < hi[0] <= 1 + lf.ratio_clip_max <= hi[1],
               "calibration.clip_low_range",
               f"need 0 < low_range {lo} around 1 - loss_fn.ratio_clip_min, below high_range {hi} around "
               "1 + loss_fn.ratio_clip_max")
        _check(cal.clip_low_range[0] <= cal.clip_init_low <= cal.clip_low_range[1], "calibration.clip_init_low",
               f"must lie in calibration.clip_low_range {cal.clip_low_range}, got {cal.clip_init_low}")
        _check(cal.clip_high_range[0] <= cal.clip_init_high <= cal.clip_high_range[1], "calibration.clip_init_high",
               f"must lie in calibration.clip_high_range {cal.clip_high_range}, got {cal.clip_init_high}")


def _validate_lengths(c):
    """Sequence lengths: a longest prompt plus its generation fits the engine's and the trainer's sequence length."""
    p = c.policy
    vc = p.generation.vllm_cfg
    _check(p.generation.max_new_tokens + c.data.max_input_seq_length <= vc.max_model_len,
           "policy.generation.vllm_cfg.max_model_len",
           f"{vc.max_model_len} is shorter than data.max_input_seq_length + policy.generation.max_new_tokens")
    _check(p.generation.max_new_tokens + c.data.max_input_seq_length <= p.max_total_sequence_length,
           "policy.max_total_sequence_length",
           f"{p.max_total_sequence_length} < data.max_input_seq_length ({c.data.max_input_seq_length}) + "
           f"policy.generation.max_new_tokens ({p.generation.max_new_tokens})")
    for key in ("train_mb_tokens", "logprob_mb_tokens"):  # a batch holds at least one whole sequence
        n = getattr(p.sequence_packing, key)
        _check(n is None or n >= p.max_total_sequence_length, f"policy.sequence_packing.{key}",
               f"{n} is less than policy.max_total_sequence_length ({p.max_total_sequence_length}): the longest "
               "sequence would not fit in one batch")


def _validate_checkpointing(c):
    """Checkpointing: a save period and a number kept that make sense, and resume only with checkpoints on."""
    ck = c.checkpointing
    if ck.enabled:
        _check(ck.save_period >= 1, "checkpointing.save_period", f"must be >= 1, got {ck.save_period}")
        _check(ck.keep_last_k is None or ck.keep_last_k >= 1, "checkpointing.keep_last_k", "must be >= 1 or null")
    _check(not ck.resume or ck.enabled, "checkpointing.resume", "resume needs checkpointing.enabled: true")


_SET_NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_EMBEDDED_SET = re.compile(r"^embedded:digits(\d+)$")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


def embedded_set_digits(path: str) -> int | None:
    """N of an ``embedded:digits<N>`` evaluation-set path, else None."""
    m = _EMBEDDED_SET.match(path)
    return int(m.group(1)) if m else None


def _validate_evaluation(c):
    ev, names = c.evaluation, set()
    for i, s in enumerate(ev.sets):
        key = f"evaluation.sets[{i}]"
        _check(bool(_SET_NAME.match(s.name)), f"{key}.name",
               f"{s.name!r}: use 1-40 letters, digits, '_' or '-' (it becomes the metric prefix val/<name>/)")
        _check(s.name != "main", f"{key}.name", "'main' is the data.validation_path set; pick another name")
        _check(s.name not in names, f"{key}.name", f"{s.name!r} names two evaluation sets")
        names.add(s.name)
        _check(s.max_samples >= 1, f"{key}.max_samples", f"must be >= 1, got {s.max_samples}")
        if s.path.startswith(EMBEDDED):
            n = embedded_set_digits(s.path)
            _check(n is not None and 1 <= n <= 12, f"{key}.path",
                   f"{s.path!r}: embedded sets are 'embedded:digits<N>' with 1 <= N <= 12 (N-digit addition)")
            task = s.task or c.data.task
            _check(task == "addition", f"{key}.path",
                   f"{s.path!r} is an addition set, but the set's task is {task!r} (data.task / {key}.task)")
        else:
            _check(s.path.endswith(_DATA_SUFFIXES), f"{key}.path",
                   f"{s.path!r}: expected 'embedded:digits<N>' or a {' / '.join(_DATA_SUFFIXES)} file")
        for col in ("question_key", "answer_key"):
            v = getattr(s, col)
            _check(v is None or bool(v), f"{key}.{col}", "column names must be non-empty (or unset: data.*)")
    _check(ev.num_samples >= 0, "evaluation.num_samples",
           f"must be >= 0 (0 = no sampled evaluation), got {ev.num_samples}")
    if ev.num_samples:
        _check(len(ev.pass_k) >= 1 and all(k >= 1 for k in ev.pass_k), "evaluation.pass_k",
               f"needs k >= 1 values, got {list(ev.pass_k)}")
        _check(max(ev.pass_k) <= ev.num_samples, "evaluation.pass_k",
               f"the unbiased pass@k needs n >= k samples: k={max(ev.pass_k)} > evaluation.num_samples="
               f"{ev.num_samples}")
    for i, name in enumerate(ev.sampled_sets):
        _check(name == "main" or name in names, f"evaluation.sampled_sets[{i}]",
               f"{name!r} is not a validation set (main, or a name in evaluation.sets: {sorted(names)})")
    _check(ev.sampled_max_prompts >= 1, "evaluation.sampled_max_prompts",
           f"must be >= 1, got {ev.sampled_max_prompts}")
    _check(ev.bootstrap_samples >= 100, "evaluation.bootstrap_samples",
           f"must be >= 100 for a percentile interval, got {ev.bootstrap_samples}")
    d = c.testing.fault_val_accuracy_drop
    _check(0.0 <= d < 1.0, "testing.fault_val_accuracy_drop", f"TEST-ONLY fault: must be in [0, 1), got {d}")
    for key in ("fault_kill_rollout_at_step", "fault_kill_policy_at_step", "fault_skip_refit_at_step"):
        s = getattr(c.testing, key)
        _check(0 <= s <= c.grpo.max_num_steps, f"testing.{key}",
               f"TEST-ONLY fault: a step in [1, grpo.max_num_steps={c.grpo.max_num_steps}] (0 = off), got {s}")


def _validate_model_size(c):
    """The embedded model's size keys: positive, for the embedded model only (MoE keys for ``model: moe`` only), and
    shapes the FP8 recipes tile (as TinyModelSpec checks): every FP8 linear's input features (hidden_size,
    intermediate sizes) a multiple of 128 for the 128x128 weight blocks and 1x128 activation groups, the K/V
    projections' output a multiple of 64, heads that divide, a head size vLLM's CPU attention takes."""
    b, set_keys = c.bootstrap, c.bootstrap.model_size()
    for key, value in set_keys.items():
        _check(value >= 1, f"bootstrap.{key}", f"must be a positive integer, got {value}")
        _check(c.policy.model_name == EMBEDDED, f"bootstrap.{key}",
               f"sizes the embedded model only, but policy.model_name is {c.policy.model_name!r}")
        _check(b.model == "moe" or key not in MOE_SIZE_KEYS, f"bootstrap.{key}", "applies to bootstrap.model: moe only")
    size = {**TINY_MODEL_SIZE, **set_keys}
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
        _check(size[key] % 128 == 0, f"bootstrap.{key}",
               f"{size[key]} is not a multiple of 128 (FP8 weight blocks are 128x128)")
    hidden, heads, kv = size["hidden_size"], size["num_attention_heads"], size["num_key_value_heads"]
    _check(hidden % heads == 0, "bootstrap.num_attention_heads",
           f"{heads} does not divide bootstrap.hidden_size {hidden}")
    _check(heads % kv == 0, "bootstrap.num_key_value_heads", f"{kv} does not divide bootstrap.num_attention_heads {heads}")
    head = hidden // heads
    _check(head % 32 == 0, "bootstrap.num_attention_heads",
           f"head size {hidden} / {heads} = {head} is not a multiple of 32 (vLLM's CPU attention and FP8 KV cache)")
    _check(kv * head % 64 == 0, "bootstrap.num_key_value_heads",
           f"K/V projection width {kv} x {head} = {kv * head} is not a multiple of 64 (FP8 linears' output features)")
    if b.model == "moe":
        _check(2 <= size["num_experts_per_tok"] <= size["num_experts"], "bootstrap.num_experts_per_tok",
               f"must be in [2, num_experts={size['num_experts']}], got {size['num_experts_per_tok']}")
