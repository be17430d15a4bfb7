"""The checkpoint a rollout engine serves, and the refits checked against it: the model directory's config.json
(a supported architecture, the sizes the engine needs), the parameter shapes from the safetensors headers, and the
validation of refit weights -- every HF parameter in high precision, or the trainer's served FP8 state
(``fp8core.serve``: FP8 codes + ``weight_scale_inv`` for the FP8 layers' weights). Each problem raises ValueError
naming it before anything reaches the engine. Used by rollout/engine.py (``RolloutWorker``) and by the driver's
load-time KV check (cluster/runtime.py ``check_rollout_kv``)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

# SCALE_SUFFIX: <module>.weight -> <module>.weight_scale_inv (FP8 refits)
from fp8core.serve import SCALE_SUFFIX, scale_from_served, served_scale_dtype

# Decoder-only architectures whose linears / attention layout the FP8 method and the KV-scale setter handle (dense,
# and Qwen3-MoE: experts through rollout/vllm_fp8.py Fp8CoreMoEMethod / rollout/vllm_bf16.py Bf16EmulatedMoEMethod).
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM")


def _read_model_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise ValueError(f"model_dir {str(model_dir)!r} does not exist or is not a directory")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} has no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"{cfg_path}: architectures={archs} not supported by RolloutWorker "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if key not in cfg:
            raise ValueError(f"{cfg_path} lacks {key!r}")
    return cfg


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, read from the safetensors headers (no tensor data is loaded)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir {str(model_dir)!r} holds no *.safetensors weights")
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


def _names_error(names: set[str], *, master_names: set[str], fp8_weight_names: set[str], precision: str
                 ) -> tuple[bool, str | None]:
    """``(fp8, error)`` of a refit's names (a dict's keys or the wire's manifests): whether it is an FP8 (served
    state) refit, and the one-line reason to refuse it -- scales for an engine without FP8 layers, a name the model
    does not have, a missing parameter -- or None."""
    fp8 = any(n.endswith(SCALE_SUFFIX) for n in names)
    if fp8 and not fp8_weight_names:
        return fp8, ("refit weights carry FP8 scales (weight_scale_inv) but this engine has no FP8 layers "
                     f"(policy.generation.vllm_cfg.precision={precision!r}); send high-precision weights")
    expected = master_names | ({n + SCALE_SUFFIX for n in fp8_weight_names} if fp8 else set())
    if unknown := sorted(names - expected):
        return fp8, f"refit weights has names the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
    if missing := sorted(expected - names):
        return fp8, (f"refit weights lacks {len(missing)} parameters (a refit must be complete): "
                     f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return fp8, None


def check_refit_weights(weights, *, param_shapes: Mapping[str, tuple[int, ...]], master_names: set[str],
                        fp8_weight_names: set[str], fp8_spec, precision: str
                        ) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """Validate a refit; returns the (name, tensor) items and whether it is an FP8 (served-state) refit."""
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("weights must be a non-empty dict {HF parameter name: tensor}")
    fp8, error = _names_error(set(weights), master_names=master_names, fp8_weight_names=fp8_weight_names,
                              precision=precision)
    if error:
        raise ValueError(error)
    items = []
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"refit weights[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if name.endswith(SCALE_SUFFIX):
            continue  # checked with its weight below
        if tuple(t.shape) != param_shapes[name]:
            raise ValueError(f"refit weights[{name!r}] has shape {tuple(t.shape)}, "
                             f"the model expects {param_shapes[name]}")
        if fp8 and name in fp8_weight_names:
            if t.dtype == torch.uint8:  # FP8 codes sent as bytes (float8 tensors do not pickle in torch 2.13)
                t = t.view(torch.float8_e4m3fn)
            scale = weights[name + SCALE_SUFFIX]
            if isinstance(scale, torch.Tensor):  # E8M0 scales likewise as their bytes
                scale = scale_from_served(scale.detach(), fp8_spec.weight_granularity)
            check_fp8_weight(name, t, scale, fp8_spec)
            items += [(name, t), (name + SCALE_SUFFIX, scale)]
            continue
        if not t.is_floating_point() or t.dtype.itemsize < 2:
            raise ValueError(f"refit weights[{name!r}] has dtype {t.dtype}; pass BF16/FP16/FP32 master weights"
                             + (" (FP8 codes only for the FP8 layers' weights)" if fp8 else ""))
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"refit weights[{name!r}] has non-finite values")
        items.append((name, t))
    return items, fp8


def check_fp8_weight(name: str, data: torch.Tensor, scale, fp8_spec) -> None:
    from fp8core.quant import QuantizedTensor

    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"refit weights[{name!r}] has dtype {data.dtype}; an FP8 refit sends float8_e4m3fn "
                         "codes (or their uint8 bytes) for the FP8 layers")
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"refit weights[{name + SCALE_SUFFIX!r}] is a {type(scale).__name__}, not a tensor")
    want = served_scale_dtype(fp8_spec.weight_granularity)
    if scale.dtype != want:
        raise ValueError(f"refit weights[{name + SCALE_SUFFIX!r}] has dtype {scale.dtype}; {fp8_spec.recipe} serves "
                         f"its scales as {want}" + (" (or their uint8 bytes)" if want.itemsize == 1 else ""))
    scale = scale.float()
    try:
        QuantizedTensor(data, scale, fp8_spec.weight_granularity, "e4m3")
    except ValueError as e:
        raise ValueError(f"refit weights[{name + SCALE_SUFFIX!r}] ({fp8_spec.recipe}): {e}") from None
    if bool(data.view(torch.uint8).bitwise_and(0x7F).eq(0x7F).any()):
        raise ValueError(f"refit weights[{name!r}] has NaN codes")
    if not (bool(torch.isfinite(scale).all()) and bool((scale > 0).all())):
        raise ValueError(f"refit weights[{name + SCALE_SUFFIX!r}] must be finite and > 0")


def check_refit_manifest(pieces_by_name: Mapping[str, list], *, param_shapes: Mapping[str, tuple[int, ...]],
                         master_names: set[str], fp8_weight_names: set[str], fp8_spec, precision: str) -> str | None:
    """The refit wire's counterpart of :func:`check_refit_weights`, on the senders' manifests before any byte
    moves (``process.refit_wire.Piece`` per name): the same names, shapes and dtypes, or the one-line reason to
    refuse. The values are checked where they are made (the trainer refuses a non-finite weight up front) and on the
    wire by each bucket's checksum."""
    from fp8core.quant import _scale_shape

    names = set(pieces_by_name)
    fp8, error = _names_error(names, master_names=master_names, fp8_weight_names=fp8_weight_names,
                              precision=precision)
    if error:
        return error
    for name in sorted(names):
        piece = pieces_by_name[name][0]
        shape, dtype = tuple(piece.whole_shape), piece.dtype
        if name.endswith(SCALE_SUFFIX):
            weight = name[:-len(SCALE_SUFFIX)]
            want = tuple(_scale_shape(param_shapes[weight], fp8_spec.weight_granularity))
            want_dtype = str(served_scale_dtype(fp8_spec.weight_granularity)).removeprefix("torch.")
            if dtype != want_dtype or shape != want:
                return (f"refit weights[{name!r}] ({fp8_spec.recipe}) is {dtype} {shape}, the engine expects "
                        f"{want_dtype} {want}")
            continue
        if shape != tuple(param_shapes[name]):
            return f"refit weights[{name!r}] has shape {shape}, the model expects {tuple(param_shapes[name])}"
        if fp8 and name in fp8_weight_names:
            if dtype not in ("uint8", "float8_e4m3fn"):
                return f"refit weights[{name!r}] has dtype {dtype}; an FP8 refit sends float8_e4m3fn codes (as bytes)"
        elif dtype not in ("float32", "bfloat16", "float16"):
            return (f"refit weights[{name!r}] has dtype {dtype}; pass BF16/FP16/FP32 master weights"
                    + (" (FP8 codes only for the FP8 layers' weights)" if fp8 else ""))
    return None
