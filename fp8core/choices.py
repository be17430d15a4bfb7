"""Every choice set that a recipe key picks from and fp8core implements, spelled once: a ``Literal`` alias (what the
schema, configs/sections.py, annotates its keys with, so the loader checks them) and its tuple (what fp8core's own
checks and tests iterate). tests/configs/test_choices.py fails when the schema spells one of these by hand."""
from __future__ import annotations

from typing import Literal, get_args

__all__ = ["BF16_MODES", "BF16Mode", "GEMM_BACKENDS", "GemmBackend", "IMPORTANCE_SAMPLING", "ImportanceSampling",
           "KL_TYPES", "KLType", "KV_CACHE_DTYPES", "KV_CACHE_IMPLS", "KVCacheDtype", "KVCacheImpl", "LINEAR_FORMATS",
           "LinearFormat", "RECIPES", "Recipe"]

# FP8 linears: the recipe (operand granularities), the formats (e4m3 everywhere, or E5M2 gradients) and the GEMM
Recipe = Literal["blockwise", "rowwise", "tensorwise", "mxfp8"]
LinearFormat = Literal["e4m3", "hybrid"]
GemmBackend = Literal["auto", "cpu", "emulated", "scaled_mm"]
# BF16 linears on CPUs without BF16 units: emulated (FP32 GEMMs on BF16-rounded operands) or native
BF16Mode = Literal["auto", "native", "emulated"]
# the RL loss: the reference-policy KL estimator and the importance weight pi_old / pi_rollout
KLType = Literal["k1", "k2", "k3"]
ImportanceSampling = Literal["tis", "icepop", "seq_mask_tis"]
# the rollout engine's KV cache: its dtype, and how an FP8 cache is realised (vLLM's own, or BF16 rounded via E4M3)
KVCacheDtype = Literal["auto", "fp8"]
KVCacheImpl = Literal["auto", "native", "emulated"]

RECIPES: tuple[str, ...] = get_args(Recipe)
LINEAR_FORMATS: tuple[str, ...] = get_args(LinearFormat)
GEMM_BACKENDS: tuple[str, ...] = get_args(GemmBackend)
BF16_MODES: tuple[str, ...] = get_args(BF16Mode)
KL_TYPES: tuple[str, ...] = get_args(KLType)
IMPORTANCE_SAMPLING: tuple[str, ...] = get_args(ImportanceSampling)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
KV_CACHE_IMPLS: tuple[str, ...] = get_args(KVCacheImpl)
