"""The recipe's sections: frozen dataclasses, one per YAML section, with the checks that need only their own
keys (``__post_init__``); ``Config`` holds them and, once built, runs the checks across sections
(configs/validation.py). The public names are re-exported by configs/schema.py."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from configs.base import (
    DEFAULT_TASK,
    EMBEDDED,
    FP8_RECIPE_KEYS,
    MOE_SIZE_KEYS,
    TINY_MODEL_SIZE,
    ConfigError,
    _check,
)
from configs.validation import validate_config
from fp8core.choices import (
    BF16Mode,
    GemmBackend,
    ImportanceSampling,
    KLType,
    KVCacheDtype,
    KVCacheImpl,
    LinearFormat,
    Recipe,
)

__all__ = ["DEFAULT_TASK", "EMBEDDED", "FP8_RECIPE_KEYS", "MOE_SIZE_KEYS", "TINY_MODEL_SIZE", "AsyncGrpoCfg", "BootstrapCfg",
           "CalibrationCfg", "CheckpointingCfg", "ClusterCfg", "Config", "ConfigError", "DataCfg", "EvalSetCfg",
           "EvaluationCfg", "Fp8Cfg", "GenerationCfg", "GrpoCfg", "HubCfg", "LoggerCfg", "LossFnCfg", "MegatronCfg",
           "MlflowCfg", "OptimizerCfg", "PolicyCfg", "RayCfg", "RouterReplayCfg", "SchedulerCfg", "SequencePackingCfg",
           "TestingCfg", "VllmCfg", "WorkerResources", "flatten", "fp8_spec_from_keys", "fp8_spec_keys"]


# ----------------------------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class VllmCfg:
    """The rollout engine (rollout/engine.py), seed key names; the one form of its settings: the engine reads this
    section (and ``Config.rollout_fp8_spec()`` for its FP8 numerics), nothing re-validates or re-defaults it.
    ``precision: fp8`` = FP8 weights/activations in vLLM's linears."""

    precision: Literal["bfloat16", "fp8"] = "bfloat16"
    kv_cache_dtype: KVCacheDtype = "auto"  # fp8 = E4M3 cache with per-layer K/V scales from calibration
    # BF16 rollouts: auto = emulated (FP32 GEMMs on BF16-rounded operands, rollout/vllm_bf16.py) on CPUs without
    # BF16 units, native vLLM BF16 elsewhere; native | emulated force one (policy.bf16_mode is the trainer's twin).
    bf16_mode: BF16Mode = "auto"
    # How kv_cache_dtype=fp8 is realised (rollout/engine.py): native = vLLM's FP8 cache (on CPU needs AVX-512/AMX and
    # head_size % 32 == 0), emulated = BF16 cache with K/V rounded through E4M3 (any CPU; no capacity gain),
    # auto = native where vLLM allows it, else emulated.
    kv_cache_impl: KVCacheImpl = "auto"
    # FP8 numerics of the engine's linears. null = follow the trainer's policy.megatron_cfg.fp8_cfg (end-to-end FP8),
    # or blockwise / 0 / false for FP8-generation-only recipes. Set with FP8 training on, they must equal the
    # trainer's (Config.rollout_fp8_spec); the schema rejects a disagreement naming both keys.
    fp8_recipe: Recipe | None = None
    num_first_layers_in_bf16: int | None = None
    num_last_layers_in_bf16: int | None = None
    pow2_weight_scaling_factors: bool | None = None
    pow2_activation_scaling_factors: bool | None = None
    max_model_len: int = 256
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    kv_cache_memory_bytes: int | None = 64 * 2**20  # CPU: explicit KV budget (else vLLM reserves 92% of RAM)
    enforce_eager: bool = True
    # with enforce_eager false: inductor = vLLM's compilation; eager = the model traced into one graph (TorchDynamo)
    # run without Inductor (on CPU a trace of seconds instead of minutes of kernel compilation)
    compile_backend: Literal["inductor", "eager"] = "inductor"
    # how a refit reaches the engine's parameters: in_place = a served FP8 refit copied into the FP8 layers' own
    # tensors (rollout/inplace_refit.py; other refits fall back to vLLM's reload), vllm_reload = vLLM's layerwise
    # reload always
    refit_loader: Literal["in_place", "vllm_reload"] = "in_place"
    # vLLM's attention backend by name (e.g. FLASH_ATTN, TRITON_ATTN, FLASHINFER); null = TRITON_ATTN where an FP8
    # KV cache runs on a GPU (it dequantizes K / V and keeps the query in BF16, which is what the trainer's KV
    # rounding replays; FlashAttention 3 would quantize the query and P to FP8 too), vLLM's own choice elsewhere
    attention_backend: str | None = None
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
    fp8: LinearFormat = "e4m3"
    fp8_recipe: Recipe = "blockwise"
    fp8_param: bool = False
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    pow2_weight_scaling_factors: bool = False
    pow2_activation_scaling_factors: bool = False
    backend: GemmBackend = "auto"


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
    bf16_mode: BF16Mode = "auto"
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
    reference_policy_kl_type: KLType = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_importance_sampling_correction: bool = False
    importance_sampling: ImportanceSampling = "tis"
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
    # DAPO dynamic sampling: groups whose rewards are all equal are filtered out of the loss (trainer/train_step.py)
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
    tests of tests/ops/test_faults.py. ``fault_skip_refit_at_step`` = s > 0: the rollout engines ignore step s's refit
    (they keep the weights and version they hold), an engine that silently missed a refit; the step's rollout must
    refuse it (the end-to-end tests' negative control)."""

    fault_val_accuracy_drop: float = 0.0
    fault_kill_rollout_at_step: int = 0
    fault_kill_policy_at_step: int = 0
    fault_skip_refit_at_step: int = 0


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
    # a dead trainer rank fails the step within this (gloo's default: 30 min); None: 60 s for CPU trainers, 600 s for
    # GPU trainers (NCCL's collectives wait while rank 0 does tens of seconds of CPU work: the refit's gather)
    collective_timeout_s: float | None = None
    # Ray restarts a dead rollout engine (its process killed, OOM, a crash) up to this many times in a run; the step
    # whose refit or rollout it broke waits for the new engine and redoes refit + rollout (same seeds, so the same
    # samples). 0: a dead engine fails the run. A dead trainer always stops the run (resume from the last checkpoint).
    rollout_max_restarts: int = 2
    # how a refit reaches the engines: "collective" -- each trainer rank sends its own shard, one decoder layer at a
    # time, over a process group of the trainer ranks and the engines (gloo on CPU, NCCL on GPUs), into the engines'
    # parameters; "object_store" -- the whole served state gathered to rank 0 and fetched by each engine through Ray
    refit_transport: Literal["collective", "object_store"] = "collective"
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    # pin each worker to its own CPUs (trainer ranks first, policy.threads each, then the engines, vllm_cfg.threads
    # each), so that a rollout and a training step running at the same time (grpo.async_grpo) do not share cores;
    # one node only (a local Ray)
    pin_cpus: bool = False




@dataclass(frozen=True)
class BootstrapCfg:
    """Supervised warm start of the embedded tiny model (cached under ``assets_dir``), and that model's size: each size
    key is a TinyModelSpec field of the same name; null keeps the built-in size (``TINY_MODEL_SIZE``)."""

    assets_dir: str = "runs/assets"  # relative paths are relative to the working directory (shared across runs)
    sft_steps: int | None = None  # None: embedded.bootstrap.SFTConfig's default
    # The warm start's seed: null = grpo.seed (each RL seed trains its own SFT); an integer = one warm start shared
    # by runs of any grpo.seed (the experiment grids' default, experiments/grid.py: seeds then differ in RL only)
    sft_seed: int | None = None
    model: Literal["dense", "moe"] = "dense"  # the embedded tiny Qwen3, or its Mixture-of-Experts twin (8 experts, top-2)
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None  # the head size follows as hidden_size / num_attention_heads
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None  # MoE keys: bootstrap.model: moe only
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None

    def warm_start_seed(self, rl_seed: int) -> int:
        """The SFT warm start's seed of a run whose ``grpo.seed`` is ``rl_seed``."""
        return rl_seed if self.sft_seed is None else self.sft_seed

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
        validate_config(self)  # the checks across sections

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
