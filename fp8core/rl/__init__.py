"""RL math for fp8-grpo (pure torch): advantages, clipped losses, importance sampling, metrics, KV-scale calibration and
Calibrated Clipping. See each module's docstring for formulas, sources and the stable metric names."""
from fp8core.rl.advantages import dynamic_sampling_mask, grpo_advantages
from fp8core.rl.calibrated_clipping import CalibratedClipping, CalibratedClippingConfig
from fp8core.rl.importance import (
    ISKind,
    icepop_weights,
    importance_weights,
    raw_is_ratio,
    seq_mask_tis_weights,
    tis_weights,
)
from fp8core.rl.kv_calibration import (
    KVScales,
    calibrate_kv_scales,
    collect_qkv_amax,
    find_attention_modules,
    scales_from_amax,
    validate_kv_scales,
)
from fp8core.rl.losses import LossAgg, RatioLevel, clipped_pg_loss, sequence_log_ratio
from fp8core.rl.metrics import (
    clip_metrics,
    entropy_metrics,
    is_metrics,
    masked_mean,
    mismatch_metrics,
    pool_clip_metrics,
    response_length_metrics,
    token_entropy,
)

__all__ = [
    "CalibratedClipping",
    "CalibratedClippingConfig",
    "grpo_advantages",
    "dynamic_sampling_mask",
    "ISKind",
    "tis_weights",
    "icepop_weights",
    "seq_mask_tis_weights",
    "importance_weights",
    "raw_is_ratio",
    "RatioLevel",
    "KVScales",
    "calibrate_kv_scales",
    "collect_qkv_amax",
    "find_attention_modules",
    "scales_from_amax",
    "validate_kv_scales",
    "LossAgg",
    "clipped_pg_loss",
    "sequence_log_ratio",
    "masked_mean",
    "mismatch_metrics",
    "is_metrics",
    "clip_metrics",
    "pool_clip_metrics",
    "entropy_metrics",
    "token_entropy",
    "response_length_metrics",
]
