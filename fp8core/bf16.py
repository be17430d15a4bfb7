"""BF16 numerics without BF16 hardware: BF16-rounded GEMM operands, FP32 accumulation, BF16-rounded results.

Why: on CPUs without BF16 dot-product units (no AVX512_BF16 / AMX-BF16, e.g. AVX2-only machines) torch's BF16
GEMMs convert element by element and ran ~17x slower than FP32 (measured on an AVX2-only machine): a BF16 recipe there
would measure the converter, not the model. What a BF16 GEMM computes is fixed by its operands: each input is a BF16
value, products are accumulated in FP32, the result is rounded to BF16 once. An FP32 GEMM on BF16-*valued* FP32
tensors computes the same dot products (every BF16 product is exact in FP32; only the FP32 summation order may
differ, as it does between two BF16 kernels), so rounding the operands and the result gives BF16 numerics at FP32
GEMM speed.

What is emulated (:class:`BF16Emulation`, a ``TorchFunctionMode`` used where ``torch.autocast(dtype=bfloat16)``
would be): ``F.linear`` (operands and bias rounded, result rounded; the backward's dgrad and wgrad GEMMs take
BF16-rounded output gradients and round their results, as BF16 autograd does), ``matmul`` / ``mm`` / ``bmm`` (operands
and result rounded) and ``scaled_dot_product_attention`` (q, k, v and the output rounded). Tensors stay FP32
(holding BF16 values). Not emulated: autocast also runs the elementwise ops *between* GEMMs (SiLU, the gate
product, residual adds of BF16 outputs) in BF16; here they run in FP32 on BF16-valued inputs, i.e. slightly more
precise than autocast. That is the trade for FP32 speed; nightly baselines compare within one mode (the mode is
logged as a run parameter).

Rounding is torch's FP32 -> BF16 cast (round to nearest even), so ``round_bf16(x)`` equals
``x.to(bfloat16).to(float32)`` bit for bit. A Parameter's rounded copy is cached per version (like the FP8 weight
cache in fp8core.linear): one rounding per optimizer update.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fp8core.choices import BF16_MODES

__all__ = ["BF16Emulation", "BF16_MODES", "bf16_linear", "resolve_bf16_mode", "round_bf16"]



def round_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to BF16 (nearest even) and kept in its dtype; differentiable (the gradient is rounded the same
    way, as a cast to BF16 and back does). Non-FP32 tensors are returned unchanged."""
    if t.dtype != torch.float32:
        return t
    return t.to(torch.bfloat16).to(torch.float32)


def resolve_bf16_mode(mode: str, *, device: torch.device, native_bf16: bool) -> str:
    """``auto`` -> ``native`` (torch.autocast BF16) on CUDA or on a CPU with BF16 units, else ``emulated``."""
    if mode not in BF16_MODES:
        raise ValueError(f"bf16_mode={mode!r} is not supported; allowed: {', '.join(map(repr, BF16_MODES))}")
    if mode != "auto":
        return mode
    return "native" if device.type != "cpu" or native_bf16 else "emulated"


class _RoundedWeights:
    """BF16-rounded copies of weights, keyed by the tensor itself (weakly), its storage and its version counter."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), w._version, tuple(w.shape))
        hit = self._entries.get(id(w))
        if hit is not None and hit[0]() is w and hit[1] == key:
            return hit[2]
        rounded = round_bf16(w.detach())
        self._entries[id(w)] = (weakref.ref(w), key, rounded)
        return rounded

    def clear(self) -> None:
        self._entries.clear()


class _BF16Linear(torch.autograd.Function):
    """``y = bf16(bf16(x) @ W_bf16.T + bf16(b))`` with FP32 accumulation; backward as BF16 GEMMs compute it."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_r):
        """``w_r``: the weight's rounded copy (cached by the caller), or None: rounded here and again in the backward
        from the weight itself, so no copy outlives the forward (a weight gathered per use: trainer.dp)."""
        with torch._C.DisableTorchFunction():
            x_r = round_bf16(x)
            b_r = None if bias is None else round_bf16(bias.detach())
            ctx.recompute = w_r is None
            if w_r is None:
                w_r = round_bf16(weight.detach())
            y = round_bf16(F.linear(x_r, w_r, b_r))
        ctx.save_for_backward(x_r, weight if ctx.recompute else w_r)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_r, w_r = ctx.saved_tensors
        if ctx.recompute:
            w_r = round_bf16(w_r.detach())
        with torch._C.DisableTorchFunction():
            dy_r = round_bf16(dy)
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                dx = round_bf16(dy_r @ w_r)
            dy2 = dy_r.reshape(-1, dy_r.shape[-1])
            if ctx.needs_input_grad[1]:
                dw = round_bf16(dy2.t() @ x_r.reshape(-1, x_r.shape[-1]))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = round_bf16(dy2.sum(0))
        return dx, dw, db, None


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                rounded_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Emulated BF16 ``F.linear`` for FP32 tensors (module docstring). ``rounded_weight``: ``round_bf16(weight)``
    computed by the caller (e.g. cached); otherwise rounded here."""
    w_r = round_bf16(weight.detach()) if rounded_weight is None else rounded_weight
    return _BF16Linear.apply(x, weight, bias, w_r)


_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
                      torch.bmm, torch.Tensor.bmm})


class BF16Emulation(TorchFunctionMode):
    """Inside ``with BF16Emulation():`` FP32 linears, matmuls and SDPA compute BF16 numerics (module docstring).
    Reuse one instance across steps so its rounded-weight cache lives as long as the model."""

    def __init__(self):
        super().__init__()
        self.weights = _RoundedWeights()
        # False: round each weight per use and keep no copy (weights gathered per use: trainer.dp's per-layer
        # sharding, where a cached copy of every layer would undo the sharding)
        self.cache_weights = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype == torch.float32 and w.dtype == torch.float32:
                return _BF16Linear.apply(x, w, b, self.weights.get(w) if self.cache_weights else None)
        elif func in _MATMULS:
            a, b = args[0], args[1]
            if a.dtype == torch.float32 and b.dtype == torch.float32:
                return round_bf16(func(round_bf16(a), round_bf16(b), *args[2:], **kwargs))
        elif func is F.scaled_dot_product_attention:
            q, k, v = (round_bf16(t) for t in args[:3])
            return round_bf16(func(q, k, v, *args[3:], **kwargs))
        return func(*args, **kwargs)
