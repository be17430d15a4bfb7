"""FP8 linear layer for training: the three GEMMs of ``y = x @ W.T + b``, each with FP8 operands.

With tokens flattened, ``X: [T, K]`` (activations), ``W: [N, K]`` (weight), ``Y: [T, N]``, a linear layer runs
three GEMMs. Each FP8 operand is scaled along the dimension the GEMM *contracts*, so every scale factors out of
the dot products it touches and can be applied once per output tile (what FP8 GEMM kernels need):

======  =========================  ==============  =============================================================
GEMM    product                     contracts over  operand quantization (recipe "blockwise" / "rowwise" / "tensorwise")
======  =========================  ==============  =============================================================
fprop   ``Y  = X  @ W.T``           K (features)    X: group128 / rowwise / tensorwise along K;
                                                    W: block128 / rowwise / tensorwise
dgrad   ``dX = dY @ W``             N (outputs)     dY: group128 / rowwise / tensorwise along N;
                                                    W: the *same* block128 tensor as fprop (128x128 tiles are
                                                    transpose-symmetric) / W re-quantized rowwise along N
                                                    (per input feature) / the same tensorwise W
wgrad   ``dW = dY.T @ X``           T (tokens)      dY.T and X.T: group128 / rowwise / tensorwise along T
======  =========================  ==============  =============================================================

"blockwise" is the DeepSeek-V3 / NeMo RL recipe (1x128 activation/gradient groups, 128x128 weight blocks);
"rowwise" and "tensorwise" follow the operand layouts of torchao's float8 recipes of those names (torchao's
"rowwise" also rounds scales to powers of two; here that is ``pow2_weight`` / ``pow2_activation``, set per recipe in
the one spec both sides are built from, fp8core.spec.FP8Spec). Formats: "e4m3" uses
float8_e4m3fn everywhere; "hybrid" keeps X and W in E4M3 and quantizes the gradient dY in E5M2 (more range, less
precision). Scales follow fp8core.quant: FP32 dequantization multipliers ``amax / fp8_max``.

Every GEMM accumulates in FP32 and the bias is added in FP32; outputs are cast to the input's dtype (dX to x's,
dW to the weight's). Three backends compute the same products; they differ only in the order (and, on GPUs, the
precision) of the FP32 additions, so they agree to a tolerance, not bit for bit:

* ``"cpu"``: the CPU FP8 GEMM on the codes (fp8core.gemm: BF16-unit dot products with FP32 accumulation, per
  128-wide K block then scaled, in an order that does not depend on the batch -- a row's output is the same alone or
  in any batch).
* ``"emulated"``: dequantize both operands to FP32 and run an FP32 matmul (torch's GEMM: its order depends on the
  shapes, so a row's output can change with its batch). The reference the other two are compared with.
* ``"scaled_mm"``: torch's scaled_mm on the FP8 data, one call per GEMM (fp8core/scaled_mm.py): blockwise E4M3 through
  torch's one-call blockwise GEMM, rowwise / tensorwise with row / tensor scales; blockwise with E5M2 gradients (and
  where torch does not support the blockwise call, e.g. on a CPU) as one call per 128-wide K chunk, the chunks summed
  in FP32.

``"auto"`` picks scaled_mm on CUDA devices with FP8 GEMMs (capability >= 8.9), the CPU op on a CPU with BF16 units
where fp8core/csrc built, and the emulation elsewhere (see :func:`resolve_backend`).

End-to-end FP8: the training forward calls :func:`fp8_linear_forward` with the weight it has just quantized, and
the vLLM plugin calls the same function with the weight it holds (``quantize(w, "block128")``), so rollouts and
training see bit-identical forward numerics on the same backend.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8core import gemm, mx
from fp8core.choices import GEMM_BACKENDS, LINEAR_FORMATS, RECIPES
from fp8core.quant import (
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_columns,
    quantize_dequantize,
    quantize_dequantize_columns,
)
from fp8core.scaled_mm import _fp8_mm_scaled

BACKENDS = GEMM_BACKENDS  # the name fp8core.spec and the tests use
# operand granularity per recipe: activations/gradients ("act", along the contraction dim) and the fprop weight
ACT_GRANULARITY = {"blockwise": "group128", "rowwise": "rowwise", "tensorwise": "tensorwise", "mxfp8": "group32"}
WEIGHT_GRANULARITY = {"blockwise": "block128", "rowwise": "rowwise", "tensorwise": "tensorwise", "mxfp8": "group32"}
# recipes whose forward weight groups run along K only, so the dgrad (contracting N) re-quantizes W along N
REQUANTIZED_DGRAD = ("rowwise", "mxfp8")

__all__ = [
    "BACKENDS",
    "FP8Linear",
    "FP8LinearConfig",
    "LINEAR_FORMATS",
    "RECIPES",
    "WeightCache",
    "fp8_linear",
    "fp8_linear_forward",
    "fp8_linear_forward_cpu",
    "fp8_linear_forward_partitions",
    "pack_weight",
    "fp8_linear_forward_emulated",
    "fp8_mm",
    "resolve_backend",
    "weight_granularity",
]


def _check_choice(value, allowed, what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class FP8LinearConfig:
    """How an :class:`FP8Linear` quantizes its GEMM operands (module docstring).

    recipe: "blockwise" (default) | "rowwise" | "tensorwise" | "mxfp8".  fmt: "e4m3" | "hybrid" (E5M2 gradients).
    pow2_weight / pow2_activation: round the weight's / the activations' and gradients' scales up to powers of two
    (both required by mxfp8, whose scales are E8M0 exponents).
    backend: "auto" | "cpu" | "emulated" | "scaled_mm".
    """

    recipe: str = "blockwise"
    fmt: str = "e4m3"
    pow2_weight: bool = False
    pow2_activation: bool = False
    backend: str = "auto"

    def __post_init__(self):
        _check_choice(self.recipe, RECIPES, "FP8LinearConfig.recipe")
        _check_choice(self.fmt, LINEAR_FORMATS, "FP8LinearConfig.fmt")
        _check_choice(self.backend, BACKENDS, "FP8LinearConfig.backend")
        for name in ("pow2_weight", "pow2_activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8LinearConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.recipe == "mxfp8" and not (self.pow2_weight and self.pow2_activation):
            raise ValueError("FP8LinearConfig: recipe 'mxfp8' needs pow2_weight and pow2_activation (its scales are "
                             "E8M0 powers of two)")

    @property
    def grad_fmt(self) -> str:
        """FP8 format of the output gradient dY: E5M2 in the hybrid format, else E4M3."""
        return "e5m2" if self.fmt == "hybrid" else "e4m3"


def weight_granularity(recipe: str) -> str:
    """Granularity of the (forward) weight quantization for ``recipe``: block128 / rowwise / tensorwise / group32."""
    _check_choice(recipe, RECIPES, "recipe")
    return WEIGHT_GRANULARITY[recipe]


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> "scaled_mm" on CUDA devices with FP8 tensor cores (capability >= 8.9), "cpu" on a CPU with BF16
    units (AVX-512 BF16 / AMX; or the meta device) where the CPU FP8 GEMM is loaded, else "emulated". On CPUs
    without BF16 units the op's FP32 path is row-invariant but not faster than the emulation on a forward +
    backward (1.05-1.16x at the bench.gemm shapes under the AVX2 cap), so auto keeps the emulation there;
    ``backend="cpu"`` asks for the op
    anyway. "cpu" where the op does not run is an error."""
    _check_choice(backend, BACKENDS, "backend")
    on_cpu = device.type in ("cpu", "meta")
    if backend == "cpu" and not (on_cpu and gemm.available()):
        where = f"device {device.type}" if not on_cpu else f"this CPU ({gemm.path()})"
        raise ValueError(f"backend='cpu': the CPU FP8 GEMM does not run on {where}")
    if backend != "auto":
        return backend
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "scaled_mm"
    if on_cpu and gemm.available():
        from fp8core.cpu import cpu_caps

        if device.type == "meta" or cpu_caps().native_bf16:
            return "cpu"
    return "emulated"


# ---------------------------------------------------------------------------------------------------- the GEMM
def fp8_mm(a: QuantizedTensor, b: QuantizedTensor, *, backend: str = "emulated") -> torch.Tensor:
    """FP32 ``dequant(a) @ dequant(b).T`` for 2-D ``a: [M, K]``, ``b: [N, K]`` quantized along K.

    Allowed granularities: tensorwise, rowwise, group128 (all along K, the last dim) and block128 (symmetric).
    backend "cpu" (the CPU FP8 GEMM, fp8core.gemm), "emulated" (FP32 matmul of dequantized operands) or
    "scaled_mm" (torch's scaled_mm, fp8core.scaled_mm).
    """
    _check_choice(backend, ("cpu", "emulated", "scaled_mm"), "backend")
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"fp8_mm: need a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if backend == "scaled_mm":
        if a.granularity == b.granularity == "group32":  # mxfp8: torch's MX GEMM (E8M0 scales; Blackwell)
            return mx.mx_mm(mx.from_quantized(a), mx.from_quantized(b), out_dtype=torch.float32)
        return _fp8_mm_scaled(a, b)
    if backend == "cpu":
        return gemm.fp8_gemm(a, b)
    return dequantize(a) @ dequantize(b).t()


# ---------------------------------------------------------------------------------------------- forward + autograd
def fp8_linear_forward(x: torch.Tensor, weight_q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                       recipe: str = "blockwise", pow2_activation: bool = False,
                       backend: str = "auto", weight_dq: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 forward ``y = fp8(x) @ weight_q.T + bias`` with an already-quantized weight (inference and training).

    x: [..., K] quantized in E4M3 along K (group128 / rowwise / tensorwise for recipe blockwise / rowwise /
    tensorwise); weight_q: [N, K] with the recipe's weight granularity (block128 / rowwise / tensorwise).
    FP32 accumulation, bias added in FP32, result in x's dtype. Shared by FP8Linear and the vLLM plugin.
    ``weight_dq``: optionally ``dequantize(weight_q)`` computed once by the caller (the emulation then skips it;
    it must be exactly that tensor's values).
    """
    _check_choice(recipe, RECIPES, "recipe")
    expected = WEIGHT_GRANULARITY[recipe]
    if weight_q.granularity != expected:
        raise ValueError(f"fp8_linear_forward: recipe={recipe!r} needs a {expected!r} weight, got "
                         f"weight_q.granularity={weight_q.granularity!r}")
    if weight_q.data.dim() != 2 or x.shape[-1] != weight_q.data.shape[1]:
        raise ValueError(f"fp8_linear_forward: x of shape {tuple(x.shape)} does not match weight_q of shape "
                         f"{tuple(weight_q.shape)} (need x[..., K] and weight [N, K])")
    backend = resolve_backend(backend, x.device)
    if backend == "emulated":
        return fp8_linear_forward_emulated(x, dequantize(weight_q) if weight_dq is None else weight_dq, bias,
                                           recipe=recipe, pow2_activation=pow2_activation)
    if backend == "cpu":
        return fp8_linear_forward_cpu(x, pack_weight(weight_q, recipe), bias, recipe=recipe,
                                      pow2_activation=pow2_activation)
    return fp8_linear_forward_partitions(x, [weight_q], bias, recipe=recipe, pow2_activation=pow2_activation,
                                         backend=backend)


def fp8_linear_forward_partitions(x: torch.Tensor, parts: list[QuantizedTensor], bias: torch.Tensor | None = None, *,
                                  recipe: str, pow2_activation: bool, backend: str) -> torch.Tensor:
    """:func:`fp8_linear_forward`'s GEMM path (``fp8_mm``: scaled_mm, or the CPU op / emulation on codes) for a
    weight in partitions side by side along N (q/k/v, gate/up, each quantized on its own; one partition for a plain
    linear): ``x`` quantized once, one GEMM per partition -- the shapes of separate linears, so the same kernels --
    their FP32 outputs side by side, + bias in FP32, in x's dtype."""
    x_q = quantize(x.reshape(-1, x.shape[-1]), ACT_GRANULARITY[recipe], fmt="e4m3", pow2=pow2_activation)
    ys = [fp8_mm(x_q, w, backend=backend) for w in parts]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def pack_weight(weight_q: QuantizedTensor | list[QuantizedTensor], recipe: str) -> gemm.PackedWeight:
    """``weight_q`` (quantized along its last dim) packed for the CPU FP8 GEMM against ``recipe``'s activations; a
    list of partitions (each quantized on its own: q/k/v, gate/up) is packed side by side along N."""
    parts = [weight_q] if isinstance(weight_q, QuantizedTensor) else weight_q
    block = gemm.block_for(ACT_GRANULARITY[recipe], parts[0].granularity, parts[0].data.shape[1])
    codes = parts[0].data if len(parts) == 1 else torch.cat([q.data for q in parts])
    return gemm.pack_weight(codes, parts[0].fmt, torch.cat([gemm.row_scales(q, block) for q in parts]), block)


def fp8_linear_forward_cpu(x: torch.Tensor, weight: gemm.PackedWeight, bias: torch.Tensor | None = None, *,
                           recipe: str = "blockwise", pow2_activation: bool = False) -> torch.Tensor:
    """:func:`fp8_linear_forward` on the CPU FP8 GEMM with the weight packed (:func:`pack_weight`, once per refit or
    optimizer update). The trainer's FP8Linear and the engine's FP8 layers both run this function; the engine packs
    several partitions side by side (q/k/v, gate/up, each quantized on its own), so the activation is quantized once
    and each output column is the same dot product as with the partitions one by one."""
    y = _quantized_gemm(x.reshape(-1, weight.k), ACT_GRANULARITY[recipe], "e4m3", pow2_activation, weight)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.n)


def _quantized_gemm(x2: torch.Tensor, granularity: str, fmt: str, pow2: bool, weight: gemm.PackedWeight) -> torch.Tensor:
    """FP32 ``quantize(x2) @ W.T`` on the CPU op: quantized inside the op where the groups are its K blocks
    (group128, rowwise), else quantize() first (tensorwise's one scale needs all of x2 before any code)."""
    if gemm.quantizes_into_pack(granularity, weight):
        return gemm.fp8_quant_gemm_packed(x2, fmt, weight, pow2=pow2)
    q = quantize(x2, granularity, fmt=fmt, pow2=pow2)
    return gemm.fp8_gemm_packed(q.data, fmt, gemm.row_scales(q, weight.block), weight)


def fp8_linear_forward_emulated(x: torch.Tensor, weight_dq: torch.Tensor, bias: torch.Tensor | None = None, *,
                                recipe: str = "blockwise", pow2_activation: bool = False) -> torch.Tensor:
    """The emulation of :func:`fp8_linear_forward` given the dequantized weight ``weight_dq`` [N, K] (FP32 values
    of an FP8 weight): ``dequantize(quantize(x)) @ weight_dq.T`` in FP32, + bias in FP32, in x's dtype.

    The activation's quantization does not depend on the weight, so a serving engine whose fused layer holds several
    FP8 weights side by side (q/k/v, gate/up: each quantized on its own) passes them concatenated along N and
    quantizes the activation once: each output column is the same dot product as with the weights one by one."""
    _check_choice(recipe, RECIPES, "recipe")
    k, n = weight_dq.shape[1], weight_dq.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear_forward_emulated: x of shape {tuple(x.shape)} does not match weight_dq of "
                         f"shape {tuple(weight_dq.shape)}")
    # dequantize(quantize(x)) in one pass (bit for bit), then the same FP32 GEMM fp8_mm runs
    x_dq = quantize_dequantize(x.reshape(-1, k), ACT_GRANULARITY[recipe], fmt="e4m3", pow2=pow2_activation)[0]
    y = x_dq @ weight_dq.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


class WeightCache:
    """The quantized (and, for the emulation, dequantized) weight of one FP8Linear, reused until the weight changes.

    A weight is re-quantized once per optimizer update instead of once per forward (micro-batches, the old-logprob
    pass, dgrad). The key is the Parameter object itself (weakly held), its storage address and its version counter,
    which every in-place update bumps (optimizer steps, ``load_state_dict``, ``copy_`` under no_grad). Writes that
    bypass the version counter (through ``weight.data``) are not seen: call :meth:`clear` after such writes.
    """

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._ref = None
        self._key = None
        self._vals: dict[str, object] = {}

    def _fresh(self, weight: torch.Tensor, config: FP8LinearConfig) -> dict:
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), config.recipe,
               config.pow2_weight)
        if self._ref is None or self._ref() is not weight or self._key != key:
            self._ref, self._key, self._vals = weakref.ref(weight), key, {}
        return self._vals

    def get(self, weight: torch.Tensor, config: FP8LinearConfig, *, dequantized: bool = False):
        """(weight_q, weight_dq or None): ``quantize(weight, WEIGHT_GRANULARITY[recipe])`` and its dequantization."""
        vals = self._fresh(weight, config)
        if "q" in vals and dequantized and "dq" not in vals:
            vals["dq"] = dequantize(vals["q"])
        if "q" not in vals:
            gran = WEIGHT_GRANULARITY[config.recipe]
            if dequantized:
                vals["dq"], vals["q"] = quantize_dequantize(weight.detach(), gran, fmt="e4m3",
                                                            pow2=config.pow2_weight, keep_data=True)
            else:
                vals["q"] = quantize(weight.detach(), gran, fmt="e4m3", pow2=config.pow2_weight)
        return vals["q"], vals.get("dq") if dequantized else None

    def packed(self, weight: torch.Tensor, config: FP8LinearConfig, *, transposed: bool = False) -> gemm.PackedWeight:
        """The weight packed for the CPU FP8 GEMM: the forward's (``[N, K]``), or with ``transposed`` the dgrad's
        (``[K, N]``: the forward's block128 / tensorwise codes transposed, exact; rowwise / group32 re-quantized
        along N)."""
        vals = self._fresh(weight, config)
        key = "packed_t" if transposed else "packed"
        if key not in vals:
            if transposed and config.recipe in REQUANTIZED_DGRAD:
                q = quantize(weight.detach().t(), WEIGHT_GRANULARITY[config.recipe], fmt="e4m3",
                             pow2=config.pow2_weight)
            else:
                q = self.get(weight, config)[0]
                q = q.t() if transposed else q
            vals[key] = pack_weight(q, config.recipe)
        return vals[key]

    def get_requantized_t(self, weight: torch.Tensor, config: FP8LinearConfig) -> torch.Tensor:
        """The dgrad weight of a recipe in REQUANTIZED_DGRAD: ``dequantize(quantize(weight.t(), gran))`` ([K, N],
        FP32), gran its weight granularity (rowwise, group32)."""
        vals = self._fresh(weight, config)
        if "dq_t" not in vals:
            vals["dq_t"] = quantize_dequantize_columns(weight.detach(), WEIGHT_GRANULARITY[config.recipe],
                                                       fmt="e4m3", pow2=config.pow2_weight).t()
        return vals["dq_t"]


class _FP8LinearFunction(torch.autograd.Function):
    """Autograd for the three FP8 GEMMs (module docstring table).

    With a :class:`WeightCache` the forward's quantized weight (and, for the emulation, its dequantization) is saved
    for the backward. Without one (``cache=None``: :func:`fp8_linear`, or an FP8Linear whose weight is gathered per
    use, as in a per-layer sharded data-parallel trainer) only the weight itself is saved and the backward
    quantizes it again -- the same codes and scales, as quantization is deterministic -- so no quantized copy of the
    weight outlives the layer's forward (FSDP frees the gathered weight after the forward and gathers it again
    for the backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, config: FP8LinearConfig, cache: WeightCache | None):
        # FP8 numerics are fixed here: no torch-function mode (e.g. fp8core.bf16.BF16Emulation) may re-round them
        with torch._C.DisableTorchFunction():
            return _FP8LinearFunction._forward(ctx, x, weight, bias, config, cache)

    @staticmethod
    def _forward(ctx, x, weight, bias, config: FP8LinearConfig, cache: WeightCache | None):
        backend = resolve_backend(config.backend, x.device)
        emulated = backend == "emulated"
        if backend == "cpu":  # the packed weight is cached with the codes (a fresh one per use without a cache)
            y = fp8_linear_forward_cpu(x, (WeightCache() if cache is None else cache).packed(weight, config), bias,
                                       recipe=config.recipe, pow2_activation=config.pow2_activation)
        else:
            w_q, w_dq = (WeightCache() if cache is None else cache).get(weight, config, dequantized=emulated)
            y = fp8_linear_forward(x, w_q, bias, recipe=config.recipe, pow2_activation=config.pow2_activation,
                                   backend=backend, weight_dq=w_dq)
        if cache is None or backend == "cpu":  # the cpu backward takes its packed dgrad weight from the cache
            ctx.save_for_backward(x, weight)
        elif emulated:
            ctx.save_for_backward(x, weight, w_dq)
        else:
            ctx.save_for_backward(x, weight, w_q.data, w_q.scale)
        ctx.config, ctx.cache, ctx.backend = config, cache, backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        cfg: FP8LinearConfig = ctx.config
        cache = ctx.cache
        if ctx.backend == "cpu":  # without a cache: the re-gathered weight, quantized and packed again
            x, weight = ctx.saved_tensors
            cache = WeightCache() if cache is None else cache
        elif cache is None:  # quantize the (re-gathered) weight again: the forward's codes and scales
            x, weight = ctx.saved_tensors
            cache = WeightCache()
            w_q, w_dq = cache.get(weight, cfg, dequantized=ctx.backend == "emulated")
            w_data, w_scale = w_q.data, w_q.scale
        elif ctx.backend == "emulated":
            x, weight, w_dq = ctx.saved_tensors
        else:
            x, weight, w_data, w_scale = ctx.saved_tensors
        n, k = weight.shape
        gran = ACT_GRANULARITY[cfg.recipe]
        dy2 = dy.reshape(-1, n)
        dx = dw = db = None
        if ctx.backend == "emulated":  # the same operand values as the scaled_mm branch, dequantized in one pass
            if ctx.needs_input_grad[0]:  # dgrad: dX = dY @ W, contracting N
                dy_dq = quantize_dequantize(dy2, gran, fmt=cfg.grad_fmt, pow2=cfg.pow2_activation)[0]
                w_nk = cache.get_requantized_t(weight, cfg).t() if cfg.recipe in REQUANTIZED_DGRAD else w_dq
                dx = (dy_dq @ w_nk).to(x.dtype).reshape(x.shape)
            if ctx.needs_input_grad[1]:  # wgrad: dW = dY.T @ X, contracting tokens
                dyt_dq = quantize_dequantize_columns(dy2, gran, fmt=cfg.grad_fmt, pow2=cfg.pow2_activation)
                xt_dq = quantize_dequantize_columns(x.reshape(-1, k), gran, fmt="e4m3", pow2=cfg.pow2_activation)
                dw = (dyt_dq.t() @ xt_dq).to(weight.dtype)
        else:
            if ctx.needs_input_grad[0]:
                if ctx.backend == "cpu":  # the dgrad weight packed once per update (WeightCache.packed)
                    dx = _quantized_gemm(dy2, gran, cfg.grad_fmt, cfg.pow2_activation,
                                         cache.packed(weight, cfg, transposed=True))
                else:
                    dy_q = quantize(dy2, gran, fmt=cfg.grad_fmt, pow2=cfg.pow2_activation)
                    if cfg.recipe in REQUANTIZED_DGRAD:  # W re-quantized along N (per input feature / 1x32)
                        w_t = quantize(weight.t(), WEIGHT_GRANULARITY[cfg.recipe], fmt="e4m3", pow2=cfg.pow2_weight)
                    else:  # the forward's block128 / tensorwise weight, transposed (exact)
                        w_t = QuantizedTensor(w_data, w_scale, WEIGHT_GRANULARITY[cfg.recipe], "e4m3").t()
                    dx = fp8_mm(dy_q, w_t, backend=ctx.backend)
                dx = dx.to(x.dtype).reshape(x.shape)
            if ctx.needs_input_grad[1]:
                # quantize(dy2.t()) / quantize(x.t()), bit for bit, without transposed copies where the fused kernel
                # runs (the CPU op reads the transposed views; scaled_mm pads them into contiguous operands)
                dyt_q = quantize_columns(dy2, gran, fmt=cfg.grad_fmt, pow2=cfg.pow2_activation)
                xt_q = quantize_columns(x.reshape(-1, k), gran, fmt="e4m3", pow2=cfg.pow2_activation)
                dw = fp8_mm(dyt_q, xt_q, backend=ctx.backend).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: str = "blockwise", fmt: str = "e4m3", pow2_weight: bool = False,
               pow2_activation: bool = False, backend: str = "auto") -> torch.Tensor:
    """Differentiable FP8 ``x @ weight.T + bias`` (fprop, dgrad and wgrad in FP8; module docstring)."""
    config = FP8LinearConfig(recipe=recipe, fmt=fmt, pow2_weight=pow2_weight, pow2_activation=pow2_activation,
                             backend=backend)
    return _FP8LinearFunction.apply(x, weight, bias, config, None)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 (same ``weight`` / ``bias`` parameters, so state_dicts stay
    Hugging Face compatible). Set ``fp8_enabled = False`` (or use ``fp8core.convert.high_precision``) to run the
    same master weights in high precision."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: FP8LinearConfig | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config if config is not None else FP8LinearConfig()
        if not isinstance(self.config, FP8LinearConfig):
            raise ValueError(f"FP8Linear config must be an FP8LinearConfig, got {type(self.config).__name__}")
        self.fp8_enabled = True
        # None: quantize per use and keep no copy (a weight gathered per use: trainer.dp's per-layer sharding)
        self.weight_cache: WeightCache | None = WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: FP8LinearConfig | None = None) -> FP8Linear:
        """Wrap an existing nn.Linear, sharing its Parameter objects (optimizer state and tying survive)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def quantized_weight(self) -> QuantizedTensor:
        """The forward weight quantization of this layer's recipe (what a serving engine should hold)."""
        return (self.weight_cache or WeightCache()).get(self.weight, self.config)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self.config, self.weight_cache)

    def extra_repr(self) -> str:
        c = self.config
        return (f"{super().extra_repr()}, recipe={c.recipe}, fmt={c.fmt}, pow2_weight={c.pow2_weight}, "
                f"pow2_activation={c.pow2_activation}, backend={c.backend}, fp8_enabled={self.fp8_enabled}")
