"""KV-cache (and Q) FP8 scale calibration on the trainer's model, in the form the rollout worker applies at refit.

Recipe (NeMo RL FP8 KV cache; "Towards Full Pipeline FP8 Reinforcement Learning for LLMs"): run the current policy on
prompt + response token ids; in every attention layer capture Q and K *after* RoPE (and after the per-head q/k RMSNorm
of Qwen3) and V — exactly the tensors the inference engine writes into / reads from its KV cache — and per layer take

    amax_{l,m}  = max |x| over the valid (attention_mask == 1) tokens, heads and channels of micro-batch m
    scale_l     = percentile_p({amax_{l,m}}_m) * margin / fp8_max                      (FP32, dequantization multiplier)

with ``p = 99.9`` and ``margin = 1.05`` by default and ``fp8_max = 448`` (e4m3). The percentile is linear interpolation
over the micro-batch amaxes (``torch.quantile``): with M micro-batches it sits between the two largest amaxes, and
``percentile=100`` is the plain max. Scales follow fp8core's convention (``x ~= fp8 * scale``, vLLM's ``_k_scale``)
and are floored at ``fp8core.quant.MIN_SCALE`` so an all-zero layer never gives 0/NaN.

Public API
----------
``collect_qkv_amax(model, batches) -> {"q": Tensor[M, L], "k": Tensor[M, L], "v": Tensor[M, L]}`` (float32 amaxes)
``scales_from_amax(amax, *, percentile=99.9, margin=1.05, fmt="e4m3") -> KVScales``
``calibrate_kv_scales(model, batches, *, percentile=99.9, margin=1.05, fmt="e4m3") -> KVScales``
``validate_kv_scales(scales, *, num_layers) -> None`` (ValueError naming the key and layer on a wrong layer count, a
missing key, or a non-finite / non-positive scale)
``round_through_e4m3(x, scale) -> Tensor``: what an E4M3 cache with dequantization scale ``scale`` gives back for
``x``: ``(e4m3(clamp(x / scale, +-448)) * scale)`` in ``x``'s dtype, computed in FP32, round to nearest even (the rollout
worker's emulated FP8 KV cache, and the trainer's replay of it: ``calibration.kv_rounding_in_trainer``).
Differentiable as a straight-through estimator: the gradient passes unchanged where ``|x / scale| <= 448`` and is 0
where the value saturated (as a clamp's), and is never itself rounded to FP8 (torch's own float8 cast would round it).

``KVScales`` is a plain dict, JSON-serializable: ``{"q_scale": [float] * L, "k_scale": [float] * L,
"v_scale": [float] * L}``, index = decoder layer index (``layer_idx``). The rollout worker sets layer l's
``_k_scale_float`` / ``_v_scale_float`` (and tensor copies; q where the backend uses an FP8 query) from it after every
refit.

``batches``: an iterable of micro-batches, each a mapping with ``input_ids`` ``[B, T]`` and optionally
``attention_mask`` ``[B, T]`` (1 = real token; left or right padding). Position ids are derived from the mask
(``cumsum(mask) - 1``), so left-padded sequences get the same RoPE positions as in the inference engine.

Capture point (duck-typed, no transformers import; checked against transformers 5.x Qwen3 and Llama)
----------------------------------------------------------------------------------------------------
An attention module is any module with ``q_proj``, ``k_proj``, ``v_proj`` and ``head_dim`` (HF Qwen3Attention,
LlamaAttention, ...). Forward hooks read the pre-RoPE tensors at ``q_norm`` / ``k_norm`` (or ``q_proj`` / ``k_proj`` when
the model has no q/k norm) and at ``v_proj``; a forward pre-hook on the attention module reads the
``position_embeddings`` ``(cos, sin)`` it receives; a forward hook on the attention module then re-applies RoPE with the
model's *own* ``apply_rotary_pos_emb`` (looked up in the attention class's module; a standard rotate-half fallback
otherwise). The model's forward is otherwise untouched (no global attention-registry or config changes); the hooks are
removed and the train/eval mode restored even on error. A test checks the captured tensors equal what the attention
kernel receives.
"""
from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from fp8core.quant import FP8_MAX, MIN_SCALE

__all__ = ["KVScales", "collect_qkv_amax", "scales_from_amax", "calibrate_kv_scales", "validate_kv_scales",
           "find_attention_modules", "round_through_e4m3"]

KVScales = dict[str, list[float]]
_KEYS = ("q_scale", "k_scale", "v_scale")


def find_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules (have q_proj/k_proj/v_proj/head_dim), ordered by ``layer_idx`` when present."""
    found = [m for m in model.modules() if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim"))]
    if not found:
        raise ValueError(f"no attention modules (q_proj/k_proj/v_proj/head_dim) found in {type(model).__name__}")
    if all(isinstance(getattr(m, "layer_idx", None), int) for m in found):
        found.sort(key=lambda m: m.layer_idx)
    return found


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_fn(attn: nn.Module):
    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if callable(fn):
        return fn

    def fallback(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    return fallback


class _LayerCapture:
    """Hooks for one attention layer; after each forward, ``amax`` holds (q, k, v) masked amaxes of that forward."""

    def __init__(self, attn: nn.Module, token_mask_ref: list) -> None:
        self.attn = attn
        self.head_dim = int(attn.head_dim)
        self.mask_ref = token_mask_ref
        self.rope = _rope_fn(attn)
        self.pre: dict[str, torch.Tensor] = {}
        self.cos_sin = None
        self.amax: tuple[float, float, float] | None = None
        q_src = attn.q_norm if getattr(attn, "q_norm", None) is not None else attn.q_proj
        k_src = attn.k_norm if getattr(attn, "k_norm", None) is not None else attn.k_proj
        self.handles = [
            attn.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            q_src.register_forward_hook(self._store("q")),
            k_src.register_forward_hook(self._store("k")),
            attn.v_proj.register_forward_hook(self._store("v")),
            attn.register_forward_hook(self._post_hook),
        ]

    def _store(self, name: str):
        def hook(_module, _inputs, output):
            b, t = output.shape[0], output.shape[1]
            self.pre[name] = output.detach().reshape(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]

        return hook

    def _pre_hook(self, _module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        self.cos_sin = pe

    def _post_hook(self, _module, _inputs, _output):
        if self.cos_sin is None or not all(k in self.pre for k in "qkv"):
            raise RuntimeError(f"KV calibration: layer {getattr(self.attn, 'layer_idx', '?')} did not expose "
                               f"q/k/v and position_embeddings to the hooks")
        cos, sin = self.cos_sin
        q, k = self.rope(self.pre["q"], self.pre["k"], cos, sin)
        self.last_qkv = (q, k, self.pre["v"])  # kept for tests / debugging of the capture point
        mask = self.mask_ref[0]  # [B, T] bool
        self.amax = tuple(_masked_amax(x, mask) for x in (q, k, self.pre["v"]))
        self.pre, self.cos_sin = {}, None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _masked_amax(x: torch.Tensor, mask: torch.Tensor) -> float:
    """max |x| over valid tokens; x is [B, H, T, D], mask [B, T]. Non-finite values propagate (caught by validation)."""
    per_token = x.float().abs().amax(dim=(1, 3))  # [B, T]
    sel = per_token[mask]
    if sel.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(sel).all()):
        return float("nan") if bool(torch.isnan(sel).any()) else float("inf")
    return float(sel.max())


def _forward_kwargs(model: nn.Module) -> dict:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    extra = {}
    if "use_cache" in params:
        extra["use_cache"] = False
    if "logits_to_keep" in params:
        extra["logits_to_keep"] = 1  # the lm_head output is not needed
    return extra


def collect_qkv_amax(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per micro-batch, per layer amax of post-RoPE Q, K and V over valid tokens -> ``{"q"|"k"|"v": [M, L]}``."""
    layers = find_attention_modules(model)
    mask_ref: list = [None]
    captures = [_LayerCapture(a, mask_ref) for a in layers]
    extra = _forward_kwargs(model)
    rows: dict[str, list[list[float]]] = {"q": [], "k": [], "v": []}
    was_training = model.training
    device = next(model.parameters()).device
    try:
        model.eval()
        with torch.no_grad():
            for i, mb in enumerate(batches):
                if "input_ids" not in mb:
                    raise ValueError(f"KV calibration micro-batch {i} has no 'input_ids'")
                ids = mb["input_ids"].to(device)
                attn_mask = mb.get("attention_mask")
                attn_mask = torch.ones_like(ids) if attn_mask is None else attn_mask.to(device)
                if attn_mask.shape != ids.shape:
                    raise ValueError(f"KV calibration micro-batch {i}: attention_mask shape {tuple(attn_mask.shape)} "
                                     f"!= input_ids shape {tuple(ids.shape)}")
                mask_ref[0] = attn_mask.bool()
                position_ids = (attn_mask.long().cumsum(-1) - 1).clamp_min(0)
                for c in captures:
                    c.amax = None
                model(input_ids=ids, attention_mask=attn_mask, position_ids=position_ids, **extra)
                for j, c in enumerate(captures):
                    if c.amax is None:
                        raise RuntimeError(f"KV calibration: attention layer {j} was not run in micro-batch {i}")
                for n, key in enumerate("qkv"):
                    rows[key].append([c.amax[n] for c in captures])
    finally:
        for c in captures:
            c.remove()
        model.train(was_training)
    if not rows["q"]:
        raise ValueError("KV calibration needs at least one micro-batch")
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in rows.items()}


def scales_from_amax(
    amax: Mapping[str, torch.Tensor], *, percentile: float = 99.9, margin: float = 1.05, fmt: str = "e4m3"
) -> KVScales:
    """``scale_l = quantile_p(amax[:, l]) * margin / fp8_max`` per layer (float64 math, floored at MIN_SCALE)."""
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got percentile={percentile}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got margin={margin}")
    if fmt not in FP8_MAX:
        raise ValueError(f"fmt={fmt!r} is not one of {sorted(FP8_MAX)}")
    out: KVScales = {}
    for key in "qkv":
        if key not in amax:
            raise ValueError(f"amax is missing key {key!r}")
        a = amax[key].to(torch.float64)
        if a.dim() != 2:
            raise ValueError(f"amax[{key!r}] must be [micro_batches, layers], got shape {tuple(a.shape)}")
        pct = torch.quantile(a, percentile / 100.0, dim=0)  # NaN/inf propagate to validation
        scale = pct * margin / FP8_MAX[fmt]
        out[f"{key}_scale"] = [s if not math.isfinite(s) else max(s, MIN_SCALE) for s in scale.tolist()]
    return out


def validate_kv_scales(scales: Mapping[str, list[float]], *, num_layers: int) -> None:
    """Raise ValueError naming the key and layer if the scales cannot be applied to a ``num_layers``-layer model."""
    for key in _KEYS:
        if key not in scales:
            raise ValueError(f"KV scales are missing key {key!r}")
        vals = list(scales[key])
        if len(vals) != num_layers:
            raise ValueError(f"KV scales {key!r} has {len(vals)} layers, model has {num_layers}")
        for layer, v in enumerate(vals):
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"KV scales {key!r} layer {layer}: scale {v!r} is not a finite positive number")


def calibrate_kv_scales(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    percentile: float = 99.9,
    margin: float = 1.05,
    fmt: str = "e4m3",
) -> KVScales:
    """Capture post-RoPE Q/K and V amaxes on ``batches`` and turn them into validated per-layer FP32 scales."""
    amax = collect_qkv_amax(model, batches)
    scales = scales_from_amax(amax, percentile=percentile, margin=margin, fmt=fmt)
    validate_kv_scales(scales, num_layers=amax["q"].shape[1])
    return scales


class _RoundThroughE4M3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        m = FP8_MAX["e4m3"]
        y = x.float() / scale
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(y.abs() <= m)
        return (y.clamp(-m, m).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None


def round_through_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` rounded through the E4M3 grid with dequantization scale ``scale`` (module docstring)."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"round_through_e4m3: scale must be a finite positive number, got {scale!r}")
    return _RoundThroughE4M3.apply(x, scale)
