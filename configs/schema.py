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

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

EMBEDDED = "embedded"  # policy.model_name / data paths: use the project's tiny model and synthetic math task
DEFAULT_TASK = "addition"  # data.task when the recipe names none (the embedded tasks: rewards/registry.py)


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message starts with the dotted key path."""


# ----------------------------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class VllmCfg:
    """The rollout engine (rollout/engine.py), seed key names; the one form of its settings: the engine reads this
    section (and ``Config.rollout_fp8_spec()`` for its FP8 numerics), nothing re-validates or re-defaults it.
    ``precision: fp8`` = FP8 weights/activations in vLLM's linears."""

    precision: Literal["bfloat16", "fp8"] = "bfloat16"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # fp8 = E4M3 cache with per-layer K/V scales from calibration
    # BF16 rollouts: auto = emulated (FP32 GEMMs on BF16-rounded operands, rollout/vllm_bf16.py) on CPUs without
    # BF16 units, native vLLM BF16 elsewhere; native | emulated force one (policy.bf16_mode is the trainer's twin).
    bf16_mode: Literal["auto", "native", "emulated"] = "auto"
    # How kv_cache_dtype=fp8 is realised (rollout/engine.py): native = vLLM's FP8 cache (on CPU needs AVX-512/AMX and
    # head_size % 32 == 0), emulated = BF16 cache with K/V rounded through E4M3 (any CPU; no capacity gain),
    # auto = native where vLLM allows it, else emulated.
    kv_cache_impl: Literal["auto", "native", "emulated"] = "auto"
    # FP8 numerics of the engine's linears. null = follow the trainer's policy.megatron_cfg.fp8_cfg (end-to-end FP8),
    # or blockwise / 0 / false for FP8-generation-only recipes. Set with FP8 training on, they must equal the
    # trainer's (Config.rollout_fp8_spec); the schema rejects a disagreement naming both keys.
    fp8_recipe: Literal["blockwise", "rowwise", "tensorwise"] | None = None
    num_first_layers_in_bf16: int | None = None
    num_last_layers_in_bf16: int | None = None
    pow2_weight_scaling_factors: bool | None = None
    pow2_activation_scaling_factors: bool | None = None
    max_model_len: int = 256
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    kv_cache_memory_bytes: int | None = 64 * 2**20  # CPU: explicit KV budget (else vLLM reserves 92% of RAM)
    enforce_eager: bool = True
    use_deep_gemm: bool = False
    max_num_seqs: int = 256  # sequences per engine step
    # tokens per engine step; chunked prefill is off (rollout/engine.py), so it must be >= max_model_len
    max_num_batched_tokens: int = 8192
    threads: int = 2  # OMP threads inside the rollout actor

    def __post_init__(self):
        path = "policy.generation.vllm_cfg"
        for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            _check(getattr(self, key) >= 1, f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")
        _check(self.max_num_batched_tokens >= self.max_model_len, f"{path}.max_num_batched_tokens",
               f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len={self.max_model_len} "
               "(chunked prefill is off: a whole prompt is prefilled in one engine step)")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, f"{path}.kv_cache_memory_bytes",
               f"must be a positive number of bytes or null, got {self.kv_cache_memory_bytes}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, f"{path}.gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")


@dataclass(frozen=True)
class GenerationCfg:
    backend: Literal["vllm"] = "vllm"
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    vllm_cfg: VllmCfg = field(default_factory=VllmCfg)


@dataclass(frozen=True)
class Fp8Cfg:
    """Trainer FP8 (seed: ``policy.megatron_cfg.fp8_cfg``). ``fp8``: e4m3 everywhere or hybrid (E5M2 gradients)."""

    enabled: bool = False
    fp8: Literal["e4m3", "hybrid"] = "e4m3"
    fp8_recipe: Literal["blockwise", "rowwise", "tensorwise"] = "blockwise"
    fp8_param: bool = False
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    pow2_weight_scaling_factors: bool = False
    pow2_activation_scaling_factors: bool = False
    backend: Literal["auto", "cpu", "emulated", "scaled_mm"] = "auto"


@dataclass(frozen=True)
class MegatronCfg:
    """The trainer section (name kept from the seed; the trainer is HF transformers + fp8core)."""

    enabled: bool = False
    fp8_cfg: Fp8Cfg = field(default_factory=Fp8Cfg)
    # NeMo RL's key: each decoder layer keeps only its inputs for the backward and recomputes its activations there
    # (trainer.dp.checkpoint_layers); less memory per micro-batch for one more forward of every layer per update
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class OptimizerCfg:
    """AdamW (torch.optim.AdamW)."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class SchedulerCfg:
    """LR = lr * warmup(step) * decay(step): linear warmup over ``warmup_steps``, then constant / linear / cosine
    decay to ``min_lr_ratio * lr`` at ``grpo.max_num_steps``."""

    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.1


@dataclass(frozen=True)
class RouterReplayCfg:
    """Mixture-of-Experts routing replay (R3): the trainer routes every token to the experts the rollout engine
    chose for it (weights from the trainer's own FP32 router logits at those experts). Off: the trainer's router
    chooses; either way MoE runs log ``moe/routing_mismatch_frac`` and ``moe/expert_load_*`` (fp8core/moe.py)."""

    enabled: bool = False


@dataclass(frozen=True)
class SequencePackingCfg:
    """Sequence packing (NeMo RL's section and keys): each training micro-batch and each no-grad logprob batch runs
    as one row holding its sequences end to end, each attending to itself only (position ids restart per sequence),
    so no padding token is computed; batches are cut by tokens instead of rows (trainer/batch.py)."""

    enabled: bool = False
    # tokens per training micro-batch / per no-grad logprob batch; None: the row sizes x max_total_sequence_length
    train_mb_tokens: int | None = None
    logprob_mb_tokens: int | None = None


@dataclass(frozen=True)
class PolicyCfg:
    # a local Hugging Face model directory, a hub id ORG/NAME (found in the Hugging Face cache, storage/hub.py), or
    # embedded (the tiny model the bootstrap builds)
    model_name: str = EMBEDDED
    model_revision: str = "main"  # hub ids only: a branch, tag or commit hash (the run pins the commit)
    tokenizer_name: str | None = None  # default: model_name
    train_global_batch_size: int = 32
    train_micro_batch_size: int = 8
    logprob_batch_size: int = 16
    max_total_sequence_length: int = 256
    precision: Literal["bfloat16", "float32"] = "bfloat16"
    # how precision=bfloat16 is computed: native = torch.autocast BF16; emulated = BF16-rounded GEMM operands and
    # results with FP32 GEMMs (fp8core.bf16; CPUs without BF16 units); auto = native where the CPU has BF16 units
    bf16_mode: Literal["auto", "native", "emulated"] = "auto"
    max_grad_norm: float = 1.0
    optimizer: OptimizerCfg = field(default_factory=OptimizerCfg)
    scheduler: SchedulerCfg = field(default_factory=SchedulerCfg)
    megatron_cfg: MegatronCfg = field(default_factory=MegatronCfg)
    generation: GenerationCfg = field(default_factory=GenerationCfg)
    router_replay: RouterReplayCfg = field(default_factory=RouterReplayCfg)
    sequence_packing: SequencePackingCfg = field(default_factory=SequencePackingCfg)
    threads: int = 2  # torch threads inside the policy actor


@dataclass(frozen=True)
class LossFnCfg:
    """Clipped policy-gradient loss (PPO/GRPO, DAPO clip-higher) with optional importance-sampling correction of the
    rollout/trainer mismatch. Ratio r = pi_theta / pi_old is clamped to [1 - ratio_clip_min, 1 + ratio_clip_max]."""

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.28
    ratio_clip_c: float | None = None  # dual-clip bound (>1) for negative advantages
    token_level_loss: bool = True
    # reference-policy KL (NeMo RL's keys): coefficient (0 = off), estimator of KL(pi || pi_ref) at the sampled tokens,
    # and the clamps of its input log-ratio and of its output (null = none); the reference is the initial policy
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_importance_sampling_correction: bool = False
    importance_sampling: Literal["tis", "icepop", "seq_mask_tis"] = "tis"
    is_truncation: float = 2.0  # TIS cap C: weight = min(pi_old/pi_rollout, C)
    is_mask_low: float | None = None  # ICE-POP / seq-mask-TIS band [low, high]; None = fp8core.rl defaults
    is_mask_high: float | None = None
    # pi_old of the ratio: "trainer" = the trainer's own logprobs before this step's first update (NeMo RL's
    # prev_logprobs; the first update has ratio 1); "rollout" = the rollout engine's logprobs of the sampled tokens
    # (the behaviour policy, as asynchronous GRPO uses): the ratio then carries the train/inference mismatch, and the
    # clip is its only importance-sampling correction (use_importance_sampling_correction must be false)
    old_logprobs: Literal["trainer", "rollout"] = "trainer"
    # GSPO (NeMo RL's key): one ratio per sequence, exp of the mean log-ratio over its tokens, clipped by
    # ratio_clip_min / _max (GSPO uses ~3e-4 / 4e-4); needs token_level_loss: false (sequence-mean aggregation)
    sequence_level_importance_ratios: bool = False


@dataclass(frozen=True)
class AsyncGrpoCfg:
    """Asynchronous GRPO (NeMo RL's section and keys): the rollouts of the next steps are generated while this step
    trains, with the weights of an earlier refit (flows/rl_step.py). A trajectory trained at step s was generated by
    the policy of step s - 1 - age, age <= max_trajectory_age_steps (steps ahead in flight)."""

    enabled: bool = False
    max_trajectory_age_steps: int = 1


@dataclass(frozen=True)
class GrpoCfg:
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 4
    max_num_steps: int = 20
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    # DAPO dynamic sampling: groups whose rewards are all equal are filtered out of the loss (trainer/policy.py)
    dynamic_sampling: bool = False
    val_period: int = 5
    val_at_start: bool = True
    max_val_samples: int = 64
    val_batch_size: int = 64
    seed: int = 0
    async_grpo: AsyncGrpoCfg = field(default_factory=AsyncGrpoCfg)


@dataclass(frozen=True)
class CalibrationCfg:
    """FP8 calibrations on the policy: KV-cache scales (sent to vLLM at each refit) and Calibrated Clipping."""

    kv_scales_period: int = 1  # steps between KV-scale calibrations when the KV cache is FP8 (0 = off)
    kv_calibration_samples: int = 8  # prompts+responses of the current batch used for KV amax
    # FP8 KV cache only: the trainer's attention rounds K and V through E4M3 with the engine's current scales
    # (trainer/kv_rounding.py), in the old-logprob and the training forwards (straight-through gradient)
    kv_rounding_in_trainer: bool = False
    # Calibrated Clipping (fp8core.rl.calibrated_clipping). The BF16 reference bounds are
    # [1 - loss_fn.ratio_clip_min, 1 + loss_fn.ratio_clip_max]: [0.8, 1.24] for GRPO, [0.8, 1.28] for DAPO.
    calibrated_clipping: bool = False
    clip_period: int = 20  # K: recalibrate the clip bounds every K steps (BF16 shadow forwards on those steps)
    clip_low_range: tuple[float, float] = (0.5, 0.9)  # search range of L
    clip_high_range: tuple[float, float] = (1.2, 2.0)  # search range of H
    clip_search_step: float = 0.02  # grid step of both searches
    clip_max_delta_low: float = 0.05  # smoothing: largest change of L per calibration
    clip_max_delta_high: float = 0.1  # smoothing: largest change of H per calibration
    clip_init_low: float = 0.6  # bounds used until the first calibration
    clip_init_high: float = 1.8


@dataclass(frozen=True)
class DataCfg:
    """Train / validation files (jsonl or parquet, file:// or s3://) or hub datasets ``ORG/NAME[@REVISION]`` found in
    the Hugging Face cache (storage/hub.py; ``train_split`` / ``validation_split`` and ``subset`` pick the rows; a path
    with a data-file suffix, a URI or an existing local path is a file). ``embedded`` = the synthetic task named by
    ``task``, which also picks the verifier (rewards/verifiers.py): ``addition`` (default; column-by-column scratchpad,
    strict ``\\boxed{}`` at the end) or ``arithmetic`` (one-fact word problems; also the GSM8K / OpenMathInstruct
    verifier: last ``\\boxed{}`` or last number)."""

    task: Literal["addition", "arithmetic"] = DEFAULT_TASK
    train_path: str = EMBEDDED
    validation_path: str = EMBEDDED
    train_split: str = "train"  # hub datasets only: the split of train_path
    validation_split: str = "validation"  # hub datasets only: the split of validation_path (GSM8K's is "test")
    subset: str | None = None  # hub datasets only: the subset (config name, GSM8K's "main"); null = the only one
    question_key: str = "question"
    answer_key: str = "answer"
    max_input_seq_length: int = 128
    shuffle: bool = True
    s3_endpoint_url: str | None = None  # credentials come from the environment, never from the recipe
    # The prompt (data/prompt.py): the system turn (text, or a file; null = the task's own, "" = none) and a user-turn
    # template file with a {question} placeholder (null = the question itself), through the chat template.
    system_prompt: str | None = None
    system_prompt_file: str | None = None
    prompt_file: str | None = None

    def __post_init__(self):
        _check(self.system_prompt is None or self.system_prompt_file is None, "data.system_prompt_file",
               "give the system prompt as data.system_prompt or as data.system_prompt_file, not both")


@dataclass(frozen=True)
class EvalSetCfg:
    """One validation set beside the main one (``data.validation_path``, named ``main``). ``path``:
    ``embedded:digits<N>`` (the addition task with N-digit operands, generated once next to the embedded assets;
    ``data.task: addition`` only) or a jsonl / parquet file (local, file://, s3://; GSM8K / OpenMathInstruct layouts
    by naming the columns). ``when``: ``period`` = at every validation (step 0, every grpo.val_period steps, the end),
    ``ends`` = at step 0 and at the last step only."""

    name: str
    path: str
    task: Literal["addition", "arithmetic"] | None = None  # the verifier; None = data.task
    question_key: str | None = None  # None = data.question_key
    answer_key: str | None = None  # None = data.answer_key
    max_samples: int = 200  # the first max_samples rows of the file (grpo.max_val_samples caps every set)
    when: Literal["period", "ends"] = "ends"


@dataclass(frozen=True)
class EvaluationCfg:
    """Validation beyond greedy accuracy on the main set: extra sets (``sets``) and sampled pass@k / avg@k
    (``num_samples`` responses per prompt at the rollout temperature, unbiased estimators of fp8core.stats; 0 = off),
    each with a 95% confidence interval. Sampled evaluation covers the first ``sampled_max_prompts`` prompts of each
    set named in ``sampled_sets`` that is validated at that step; ``sampled_when``: ``ends`` (step 0 and the last
    step) or ``period``."""

    sets: tuple[EvalSetCfg, ...] = ()
    num_samples: int = 0
    pass_k: tuple[int, ...] = (1, 8)
    sampled_sets: tuple[str, ...] = ("main",)
    sampled_max_prompts: int = 64
    sampled_when: Literal["period", "ends"] = "ends"
    bootstrap_samples: int = 2000  # resamples of the bootstrap intervals (pass@k / avg@k)


@dataclass(frozen=True)
class TestingCfg:
    """TEST-ONLY fault injection (keep at the defaults in real runs): ``fault_val_accuracy_drop`` = d > 0 turns
    round(d * prompts) of the correct greedy validation answers of every set into wrong ones (chosen with the run's
    seed), i.e. a run degraded by d accuracy points; the nightly regression's tests use it to show that its verdict
    fails on a degraded FP8 run. A run with a fault says so at start and carries the MLflow tag ``testing.fault``.
    ``fault_kill_rollout_at_step`` = s > 0: the first rollout engine SIGKILLs its own process at the end of step s's
    generation, before it returns (once per run dir); ``fault_kill_policy_at_step`` = s > 0: the last trainer rank
    SIGKILLs itself at the start of step s's update (once per run dir, so a resumed run passes it) -- the worker-loss
    tests of tests/ops/test_faults.py."""

    fault_val_accuracy_drop: float = 0.0
    fault_kill_rollout_at_step: int = 0
    fault_kill_policy_at_step: int = 0


@dataclass(frozen=True)
class CheckpointingCfg:
    enabled: bool = True
    checkpoint_dir: str = "checkpoints"  # relative = under run_dir; file://, s3://
    save_period: int = 10
    resume: bool = False
    keep_last_k: int | None = 2
    s3_endpoint_url: str | None = None


@dataclass(frozen=True)
class MlflowCfg:
    experiment_name: str = "fp8-grpo"
    run_name: str | None = None
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db


@dataclass(frozen=True)
class LoggerCfg:
    mlflow_enabled: bool = True
    mlflow: MlflowCfg = field(default_factory=MlflowCfg)
    num_val_samples_to_print: int = 4
    plot: bool = True


@dataclass(frozen=True)
class WorkerResources:
    num_cpus: float = 1
    num_gpus: float = 0


@dataclass(frozen=True)
class RayCfg:
    address: str | None = None  # None: start a local Ray on 127.0.0.1 with its temp dir under run_dir
    num_cpus: int | None = None
    # Ray token file (mode 0600) for ray.address clusters; None: RAY_AUTH_TOKEN_PATH, or a new one per local Ray
    auth_token_path: str | None = None
    policy_worker: WorkerResources = field(default_factory=WorkerResources)
    rollout_worker: WorkerResources = field(default_factory=WorkerResources)


@dataclass(frozen=True)
class ClusterCfg:
    """The run's workers on Ray. ``rollout_workers`` vLLM engines (each ``ray.rollout_worker`` resources) share every
    step's prompt groups; ``policy_workers`` trainers (each ``ray.policy_worker``); all of them in one Ray placement
    group with ``placement_strategy``. ``num_nodes`` / ``gpus_per_node`` are the seed's keys: checked against the
    workers' GPUs (more than one node needs ``ray.address``)."""

    num_nodes: int = 1
    gpus_per_node: int = 0
    rollout_workers: int = 1
    policy_workers: int = 1  # data-parallel trainers: FSDP2-sharded ranks of one process group (trainer/dp.py)
    collective_timeout_s: float = 60.0  # a dead trainer rank fails the step within this (gloo's default: 30 min)
    # Ray restarts a dead rollout engine (its process killed, OOM, a crash) up to this many times in a run; the step
    # whose refit or rollout it broke waits for the new engine and redoes refit + rollout (same seeds, so the same
    # samples). 0: a dead engine fails the run. A dead trainer always stops the run (resume from the last checkpoint).
    rollout_max_restarts: int = 2
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    # pin each worker to its own CPUs (trainer ranks first, policy.threads each, then the engines, vllm_cfg.threads
    # each), so that a rollout and a training step running at the same time (grpo.async_grpo) do not share cores;
    # one node only (a local Ray)
    pin_cpus: bool = False


# The embedded tiny model's size when no ``bootstrap`` size key is set: the values of embedded.tiny_model's
# TinyModelSpec (and TINY_MOE for the MoE keys), repeated here because configs sits below embedded and the checks of a
# partial override need them (tests/embedded/test_model_size.py keeps the two equal).
TINY_MODEL_SIZE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
MOE_SIZE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class BootstrapCfg:
    """Supervised warm start of the embedded tiny model (cached under ``assets_dir``), and that model's size: each size
    key is a TinyModelSpec field of the same name; null keeps the built-in size (``TINY_MODEL_SIZE``)."""

    assets_dir: str = "runs/assets"  # relative paths are relative to the working directory (shared across runs)
    sft_steps: int | None = None  # None: embedded.bootstrap.SFTConfig's default
    model: Literal["dense", "moe"] = "dense"  # the embedded tiny Qwen3, or its Mixture-of-Experts twin (8 experts, top-2)
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None  # the head size follows as hidden_size / num_attention_heads
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None  # MoE keys: bootstrap.model: moe only
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None

    def model_size(self) -> dict[str, int]:
        """The size keys that are set, by TinyModelSpec field name (embedded.bootstrap.model_spec applies them);
        empty = the built-in model, in its usual cache directories."""
        return {k: getattr(self, k) for k in TINY_MODEL_SIZE if getattr(self, k) is not None}


@dataclass(frozen=True)
class HubCfg:
    """The Hugging Face Hub (storage/hub.py): hub ids are looked up in the user's Hugging Face cache ($HF_HUB_CACHE,
    else $HF_HOME/hub, else ~/.cache/huggingface/hub); runs are offline (HF_HUB_OFFLINE=1) unless ``allow_downloads``,
    which downloads what the cache lacks and sets HF_HUB_OFFLINE=0 for the run's processes."""

    allow_downloads: bool = False


@dataclass(frozen=True)
class Config:
    run_dir: str = "runs/default"
    recipe: str = "custom"  # tag in MLflow; set from the YAML file name when loaded
    policy: PolicyCfg = field(default_factory=PolicyCfg)
    loss_fn: LossFnCfg = field(default_factory=LossFnCfg)
    grpo: GrpoCfg = field(default_factory=GrpoCfg)
    calibration: CalibrationCfg = field(default_factory=CalibrationCfg)
    data: DataCfg = field(default_factory=DataCfg)
    checkpointing: CheckpointingCfg = field(default_factory=CheckpointingCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    ray: RayCfg = field(default_factory=RayCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)
    evaluation: EvaluationCfg = field(default_factory=EvaluationCfg)
    testing: TestingCfg = field(default_factory=TestingCfg)
    bootstrap: BootstrapCfg = field(default_factory=BootstrapCfg)
    hub: HubCfg = field(default_factory=HubCfg)

    def __post_init__(self):
        _validate(self)

    # -- derived ------------------------------------------------------------------------------------------------------
    @property
    def precision_tag(self) -> str:
        """'bf16', 'fp8-rollout', 'fp8-e2e', 'fp8-e2e-kv' (MLflow tag)."""
        gen, train = self.policy.generation.vllm_cfg, self.policy.megatron_cfg.fp8_cfg
        if gen.precision != "fp8" and not train.enabled:
            return "bf16-kvfp8" if gen.kv_fp8 else "bf16"
        tag = "fp8-e2e" if train.enabled and gen.precision == "fp8" else (
            "fp8-rollout" if gen.precision == "fp8" else "fp8-train")
        return tag + ("-kvfp8" if gen.kv_fp8 else "")

    def trainer_fp8_spec(self):
        """The trainer's FP8 numerics (``fp8core.spec.FP8Spec``), or None when training is not FP8."""
        f8 = self.policy.megatron_cfg.fp8_cfg
        if not f8.enabled:
            return None
        return fp8_spec_from_keys({k: getattr(f8, k) for k in FP8_RECIPE_KEYS}, where="policy.megatron_cfg.fp8_cfg",
                                  fmt=f8.fp8, backend=f8.backend)

    def rollout_fp8_spec(self):
        """The rollout engine's FP8 numerics, or None for BF16 rollouts. End-to-end FP8: the trainer's spec (the
        validator has checked that explicitly set rollout keys agree). FP8 generation only: the rollout keys, unset
        ones at FP8Spec's defaults (blockwise, no BF16 layers, no pow2)."""
        vc = self.policy.generation.vllm_cfg
        if vc.precision != "fp8":
            return None
        trainer = self.trainer_fp8_spec()
        if trainer is not None:
            return fp8_spec_from_keys(fp8_spec_keys(trainer), where="policy.megatron_cfg.fp8_cfg",
                                      backend=trainer.backend)
        return fp8_spec_from_keys({k: getattr(vc, k) for k in FP8_RECIPE_KEYS if getattr(vc, k) is not None},
                                  where="policy.generation.vllm_cfg")

    def calibrated_clipping_config(self):
        """Calibrated Clipping's settings (``fp8core.rl.CalibratedClippingConfig``): the ``calibration.clip_*`` keys,
        field for field, and the BF16 reference bounds ``[1 - loss_fn.ratio_clip_min, 1 + loss_fn.ratio_clip_max]``."""
        import dataclasses

        from fp8core.rl.calibrated_clipping import CalibratedClippingConfig

        clip = {f.name: getattr(self.calibration, f.name) for f in dataclasses.fields(CalibratedClippingConfig)
                if f.name.startswith("clip_")}
        return CalibratedClippingConfig(**clip, ref_eps_low=self.loss_fn.ratio_clip_min,
                                        ref_eps_high=self.loss_fn.ratio_clip_max)

    def to_dict(self) -> dict:
        return _to_plain(self)

    def flat(self) -> dict[str, Any]:
        """Flattened resolved config (dotted keys), e.g. for MLflow params."""
        return flatten(self.to_dict())


# ------------------------------------------------------------------------------------------------------ validation
# The FP8 recipe's key names (policy.megatron_cfg.fp8_cfg.<key>, policy.generation.vllm_cfg.<key>, and the engine's
# HF quantization_config, rollout/vllm_fp8.py) -> the fp8core.spec.FP8Spec field each one sets.
FP8_RECIPE_KEYS = {"fp8_recipe": "recipe", "num_first_layers_in_bf16": "num_first_layers_in_bf16",
                   "num_last_layers_in_bf16": "num_last_layers_in_bf16",
                   "pow2_weight_scaling_factors": "pow2_weight", "pow2_activation_scaling_factors": "pow2_activation"}


def fp8_spec_from_keys(keys: Mapping[str, Any], *, where: str, **fields):
    """An ``fp8core.spec.FP8Spec`` from recipe keys (``FP8_RECIPE_KEYS``; absent keys at FP8Spec's defaults) and
    other FP8Spec ``fields``; a bad value raises ValueError naming ``<where>.<key>``."""
    from fp8core.spec import FP8Spec

    field_to_key = {f: k for k, f in FP8_RECIPE_KEYS.items()}
    try:
        return FP8Spec(**{FP8_RECIPE_KEYS[k]: v for k, v in keys.items() if k in FP8_RECIPE_KEYS}, **fields)
    except ValueError as e:
        m = re.match(r"FP8Spec\.(\w+)(.*)", str(e), re.S)
        if m is None:
            raise
        raise ValueError(f"{where}.{field_to_key.get(m.group(1), m.group(1))}{m.group(2)}") from None


def fp8_spec_keys(spec) -> dict[str, Any]:
    """The recipe keys of an ``FP8Spec``'s forward numerics (the inverse of ``fp8_spec_from_keys``)."""
    return {k: getattr(spec, f) for k, f in FP8_RECIPE_KEYS.items()}


def _check(cond: bool, path: str, msg: str):
    if not cond:
        raise ConfigError(f"{path}: {msg}")


def _validate(c: Config):
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


def _validate_sizes(c: Config):
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


def _validate_loss(c: Config):
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


def _validate_optimizer_and_sampling(c: Config):
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


def _validate_fp8(c: Config):
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
        _check(f8 == Fp8Cfg(), "policy.megatron_cfg.fp8_cfg",
               "FP8 training settings given but policy.megatron_cfg.fp8_cfg.enabled is false")
    _check(not f8.fp8_param, "policy.megatron_cfg.fp8_cfg.fp8_param",
           "FP8 parameter storage is not supported (master weights stay BF16/FP32)")


def _validate_nemo_keys(c: Config):
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


def _validate_cluster(c: Config):
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
    _check(0 < c.cluster.collective_timeout_s <= 3600, "cluster.collective_timeout_s",
           f"{c.cluster.collective_timeout_s}: must be in (0, 3600] seconds")
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


def _validate_kv_and_calibration(c: Config):
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


def _validate_lengths(c: Config):
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


def _validate_checkpointing(c: Config):
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


def _validate_evaluation(c: Config):
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
    for key in ("fault_kill_rollout_at_step", "fault_kill_policy_at_step"):
        s = getattr(c.testing, key)
        _check(0 <= s <= c.grpo.max_num_steps, f"testing.{key}",
               f"TEST-ONLY fault: a step in [1, grpo.max_num_steps={c.grpo.max_num_steps}] (0 = off), got {s}")


def _validate_model_size(c: Config):
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


# --------------------------------------------------------------------------------------------------------- loading
def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp, value, path: str):
    """Check ``value`` against the annotation ``tp`` (recursively) and return it in dataclass form."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or '<root>'}: expected a mapping (section), got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise ConfigError(f"{path}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads '1e-4' (no dot) as a string: accept numeric strings of that form.
            try:
                number = float(value) if isinstance(value, str) else None
            except ValueError:
                number = None
            if number is None:
                raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
            value = number
        value = float(value)
        if not math.isfinite(value):  # .nan / .inf parse as YAML floats; no setting means either
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover - schema bug


def _build(cls, data: Mapping, path: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{path}." if path else ""
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (valid keys here: {', '.join(sorted(names))})")
    kwargs = {k: _convert(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # pragma: no cover - schema bug
        raise ConfigError(f"{path or '<root>'}: {e}") from e


def deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"defaults: circular recipe inheritance through {path}")
    if not path.exists():
        raise ConfigError(f"recipe file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"{path}: is a directory, not a recipe file (a .yaml file, e.g. configs/tiny_fp8_e2e.yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}{_yaml_where(e)}: not valid YAML: {_yaml_problem(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as a recipe: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping at top level")
    base = data.pop("defaults", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"defaults: expected a recipe path string in {path}, got {base!r}")
    return deep_merge(_read_yaml(path.parent / base, (*seen, path)), data)


def _yaml_where(e: yaml.YAMLError) -> str:
    """':LINE:COLUMN' of a YAML error (1-based), or '' when PyYAML gives no position."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(e: yaml.YAMLError) -> str:
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    return ", ".join(p for p in parts if p) or str(e).splitlines()[0]


def parse_override(text: str) -> tuple[list[str], Any]:
    """'grpo.max_num_steps=2' → (['grpo', 'max_num_steps'], 2); the value is parsed as YAML ('null', 'true', '[1,2]')."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. grpo.max_num_steps=2)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: the override's value {raw!r} is not valid YAML: {_yaml_problem(e)}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = dict(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(f"{'.'.join(parts[:i + 1])}: is a value, cannot set {'.'.join(parts)}")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return data


def config_from_dict(data: Mapping, overrides: Sequence[str] = ()) -> Config:
    return _build(Config, apply_overrides(dict(data), overrides), "")


def standalone_engine_config(*, seed: int = 0, kv_scales_period: int = 1, **vllm_cfg: Any) -> Config:
    """A recipe for a rollout engine used on its own (benchmarks, diagnostics, tests): the schema's defaults with
    these ``policy.generation.vllm_cfg`` keys, ``grpo.seed`` and ``calibration.kv_scales_period``. The prompt budget
    (``data.max_input_seq_length``) shrinks to fit a short ``max_model_len``; nothing else is changed."""
    gen = GenerationCfg()
    max_len = vllm_cfg.get("max_model_len", VllmCfg.max_model_len)
    prompt = min(DataCfg.max_input_seq_length, max(1, max_len - gen.max_new_tokens))
    return config_from_dict({"policy": {"generation": {"vllm_cfg": dict(vllm_cfg)}},
                             "data": {"max_input_seq_length": prompt}, "grpo": {"seed": seed},
                             "calibration": {"kv_scales_period": kv_scales_period}})


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load a recipe file (+ ``defaults:`` bases) and apply ``key=value`` overrides; the ``recipe`` tag defaults to
    the file's stem."""
    path = Path(path)
    data = _read_yaml(path)
    data.setdefault("recipe", path.stem)
    return config_from_dict(data, overrides)


def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
