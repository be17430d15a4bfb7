"""The rollout engine's KV cache: how ``kv_cache_dtype`` is realised on this machine, its size, its budget check, and
the per-layer KV scales (their checks and the setter run inside the engine). Used by rollout/engine.py
(``RolloutWorker``) and by the driver's load-time check (cluster/runtime.py ``check_rollout_kv``).

``kv_cache_dtype="fp8"`` stores K/V in FP8 (e4m3) with per-layer K and V scales that we set from outside
(``set_kv_scales`` / ``refit(kv_scales=...)``). vLLM resets them to 1.0 on every weight reload, so the worker
re-applies the last scales after each refit. Two implementations (``kv_cache_impl``; ``resolve_kv_mode``):

- ``fp8-native``: vLLM's own FP8 cache (``kv_cache_dtype="fp8_e4m3"``), half the bytes per token. vLLM 0.32 on
  CPU needs AVX-512 or AMX and a head size divisible by 32 (vllm/v1/attention/backends/cpu_attn.py
  ``_get_attn_isa``); its CPU cache write truncates toward zero.
- ``fp8-emulated``: vLLM keeps a BF16 cache and a forward pre-hook on every vLLM ``Attention`` layer rounds K and
  V through the E4M3 grid with the layer's scales before they reach attention and the cache:
  ``bf16(fp32(e4m3(clamp(k / k_scale, +-448))) * k_scale)`` (round to nearest even: torch's cast). Same numerics
  contract as native (scales, saturation, per-step recalibration) on any CPU, but the capacity gain is not
  realised (``kv_capacity_tokens`` and ``kv_bytes_per_token`` are the BF16 ones) and the rounding is RNE, not
  truncation (smaller error than the native CPU cache; closer to the GPU cache, which rounds to nearest). The hook
  lives in rollout/emulation.py.

``auto`` picks native where vLLM allows it (GPU; CPU with AVX-512/AMX in the effective ``fp8core.cpu`` kind, i.e.
after the ``FP8GRPO_CPU_CAP`` cap, and head size % 32 == 0), else emulated; ``native`` where vLLM would refuse
fails in ``RolloutWorker.__init__`` (ValueError naming the key and the missing CPU feature / the head size), never
inside vLLM.

Scales inside the engine: on CPU only the Python-float copies are read (vllm/v1/attention/backends/cpu_attn.py:
``do_kv_cache_update`` and the ``cpu_attention_with_kv_cache`` call use ``layer._k_scale_float`` /
``layer._v_scale_float``); the Q scale is ignored there (no FP8 attention on CPU). ``_set_attention_scales`` sets
the float, the CPU-tensor and the device-tensor copies, so CUDA backends (which read ``_k_scale`` / ``_v_scale`` /
``_q_scale`` tensors) get them too.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fp8core.choices import KV_CACHE_DTYPES, KV_CACHE_IMPLS  # how kv_cache_dtype="fp8" is realised: docstring

KV_MODES = ("bf16", "fp8-native", "fp8-emulated")
CPU_FP8_KV_HEAD_MULTIPLE = 32  # vLLM 0.32 CPU FP8 KV cache: head_size % 32 == 0 (cpu_attn._get_attn_isa)
KV_IMPL_KEY = "policy.generation.vllm_cfg.kv_cache_impl"
CPU_KV_BLOCK_SIZE = 128  # vLLM CPU allocates the KV cache in blocks of 128 tokens


def head_size(model_cfg: Mapping) -> int:
    return int(model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_attention_heads"])


def resolve_kv_mode(model_cfg: Mapping, kv_cache_dtype: str, kv_cache_impl: str = "auto", *, caps=None,
                    on_gpu: bool = False) -> tuple[str, str]:
    """``(mode, reason)``: how the engine realises ``kv_cache_dtype`` on this machine (``KV_MODES``). ``caps`` is a
    ``fp8core.cpu.CpuCaps`` (default: this process's, after the cap). Raises ValueError naming
    ``policy.generation.vllm_cfg.kv_cache_impl`` and the missing CPU feature / the head size when ``native`` is
    asked where vLLM would refuse it. Pure: reads no files, starts nothing."""
    if kv_cache_dtype not in KV_CACHE_DTYPES or kv_cache_impl not in KV_CACHE_IMPLS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} / {KV_IMPL_KEY}={kv_cache_impl!r}: expected one of "
                         f"{KV_CACHE_DTYPES} / {KV_CACHE_IMPLS}")
    if kv_cache_dtype != "fp8":
        if kv_cache_impl != "auto":
            raise ValueError(f"{KV_IMPL_KEY}={kv_cache_impl} only applies with kv_cache_dtype=fp8")
        return "bf16", "kv_cache_dtype=auto: the model dtype (BF16) cache"
    if kv_cache_impl == "emulated":
        return "fp8-emulated", f"{KV_IMPL_KEY}=emulated"
    if on_gpu:
        return "fp8-native", "GPU: vLLM's FP8 KV cache"
    if caps is None:
        from fp8core.cpu import cpu_caps

        caps = cpu_caps()
    problems = []
    if not caps.native_fp8_kv:
        capped = f", capped by FP8GRPO_CPU_CAP={caps.cap}" if caps.capped else ""
        problems.append(f"this CPU ({caps.model}: kind {caps.kind}{capped}) lacks AVX-512 (avx512f) and AMX "
                        f"(amx_tile), which vLLM's CPU FP8 KV cache requires")
    hs = head_size(model_cfg)
    if hs % CPU_FP8_KV_HEAD_MULTIPLE:
        problems.append(f"head_size {hs} is not a multiple of {CPU_FP8_KV_HEAD_MULTIPLE}, which vLLM's CPU FP8 KV "
                        f"cache requires")
    if not problems:
        return "fp8-native", f"CPU kind {caps.kind} has {'AMX' if caps.amx else 'AVX-512'}: vLLM's FP8 KV cache"
    if kv_cache_impl == "native":
        raise ValueError(f"{KV_IMPL_KEY}=native with kv_cache_dtype=fp8: {'; '.join(problems)}. Use "
                         f"{KV_IMPL_KEY}=emulated (or auto) for a BF16 cache rounded through E4M3")
    return "fp8-emulated", "; ".join(problems) + " -> emulated (BF16 cache rounded through E4M3)"


def check_compiled_kv(kv_mode: str, enforce_eager: bool) -> None:
    """Refuse the emulated FP8 KV cache in a compiled engine: its rounding is a forward pre-hook (rollout/emulation.py)
    whose scales a traced model would keep from the trace, not take from each refit."""
    if kv_mode == "fp8-emulated" and not enforce_eager:
        raise ValueError("policy.generation.vllm_cfg.enforce_eager: false cannot run the emulated FP8 KV cache (its "
                         "rounding is a Python hook that a compiled model would run with the scales of its trace); "
                         "use enforce_eager: true, or kv_cache_impl: native where vLLM allows it")


def kv_bytes_per_token(model_cfg: Mapping, kv_cache_dtype: str) -> int:
    """KV-cache bytes one token takes over all layers: layers * 2 (K and V) * kv_heads * head_dim * element size.
    ``kv_cache_dtype`` is what the engine stores: "fp8" (native) or "auto" (BF16; also the emulated FP8 mode)."""
    heads = model_cfg.get("num_key_value_heads") or model_cfg["num_attention_heads"]
    elem = 1 if kv_cache_dtype == "fp8" else 2
    return int(model_cfg["num_hidden_layers"]) * 2 * int(heads) * head_size(model_cfg) * elem


def check_kv_budget(vc, *, on_gpu: bool, bytes_per_token: int, kv_mode: str) -> None:
    """The KV budget must hold one ``max_model_len`` sequence (on CPU it must be given at all)."""
    key = "policy.generation.vllm_cfg.kv_cache_memory_bytes"
    if vc.kv_cache_memory_bytes is None and not on_gpu:
        raise ValueError(f"{key} is required on CPU (vLLM would reserve most of the RAM)")
    if vc.kv_cache_memory_bytes is not None:
        need_tokens = math.ceil(vc.max_model_len / CPU_KV_BLOCK_SIZE) * CPU_KV_BLOCK_SIZE
        need = need_tokens * bytes_per_token
        if vc.kv_cache_memory_bytes < need:
            raise ValueError(
                f"{key}={vc.kv_cache_memory_bytes} is too small for one sequence of "
                f"max_model_len={vc.max_model_len} tokens: need >= {need} bytes "
                f"({bytes_per_token} bytes/token with kv_cache_dtype={vc.kv_cache_dtype!r}, "
                f"{kv_mode})")



def check_kv_scales(kv_scales, num_layers: int) -> dict[str, list[float]]:
    """Accepts ``{"k_scale": [L floats], "v_scale": [L floats], "q_scale": [L floats] (optional)}`` (lists or
    1-D tensors), one entry per decoder layer, each finite and > 0."""
    if not isinstance(kv_scales, Mapping):
        raise ValueError(f"kv_scales must be a dict with 'k_scale' and 'v_scale', got {type(kv_scales).__name__}")
    unknown = set(kv_scales) - {"k_scale", "v_scale", "q_scale", "version"}
    if unknown:
        raise ValueError(f"kv_scales has unknown keys {sorted(unknown)} (allowed: k_scale, v_scale, q_scale, "
                         "version)")
    out = {}
    if kv_scales.get("version") is not None:
        v = kv_scales["version"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"kv_scales['version'] must be the policy step (an int >= 0), got {v!r}")
        out["version"] = v
    for key in ("k_scale", "v_scale", "q_scale"):
        if key not in kv_scales:
            if key == "q_scale":
                continue
            raise ValueError(f"kv_scales lacks {key!r}")
        vals = kv_scales[key]
        vals = vals.detach().flatten().tolist() if isinstance(vals, torch.Tensor) else list(vals)
        if len(vals) != num_layers:
            raise ValueError(f"kv_scales[{key!r}] has {len(vals)} entries, the model has {num_layers} layers")
        for i, v in enumerate(vals):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"kv_scales[{key!r}][{i}]={v!r} must be a finite float > 0")
        out[key] = [float(v) for v in vals]
    return out


def check_kv_version(scales: Mapping | None, weights_version: int | None, max_lag: int) -> None:
    if scales is None or weights_version is None or scales.get("version") is None:
        return
    lag = weights_version - scales["version"]
    if not 0 <= lag <= max_lag:
        raise ValueError(
            f"stale KV scales: computed from the policy of step {scales['version']}, the weights being loaded "
            f"are step {weights_version}; calibration.kv_scales_period allows a lag of at most "
            f"{max_lag} step(s). Recalibrate (calibrate_kv_scales) before this refit")


# Functions run on the model inside the engine (llm.apply_model); module-level so they pickle on multi-process GPU
# setups too.
def _attention_layers(model) -> dict:
    from vllm.model_executor.layers.attention import Attention

    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}


def _layer_index(name: str) -> int:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:], strict=False):
        if a == "layers" and b.isdigit():
            return int(b)
    raise ValueError(f"cannot find a layer index in attention layer name {name!r}")


def _attention_layer_names(model) -> list[str]:
    return sorted(_attention_layers(model), key=_layer_index)


def _set_attention_scales(model, names: list[str], scales: dict[str, list[float]]) -> None:
    layers = _attention_layers(model)
    for i, name in enumerate(names):
        layer = layers[name]
        for key in ("k", "v", "q"):
            if f"{key}_scale" not in scales:
                continue
            value = scales[f"{key}_scale"][i]
            setattr(layer, f"_{key}_scale_float", value)
            getattr(layer, f"_{key}_scale").fill_(value)
            cpu_copy = getattr(layer, f"_{key}_scale_cpu", None)
            if cpu_copy is not None:
                cpu_copy.fill_(value)
