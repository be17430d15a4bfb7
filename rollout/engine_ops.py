"""The engine's FP8 linears and its experts (FP8 and BF16-emulated MoE) as ``torch.library`` ops, so that vLLM can
compile the model around them.

vLLM compiles a model's forward (``enforce_eager: false``): TorchDynamo traces it once into a graph, which runs
eagerly (the ``eager`` backend), through Inductor, and on GPUs inside CUDA graphs. fp8core's forward is not
traceable as Python -- the CPU op reads the activations' amax back to the host to refuse non-finite input, and the
quantizer picks its path from shapes and CPU features at run time; the experts loop over the experts the batch
routed to (data-dependent control flow). So an FP8 layer's ``apply`` is a single call,
``torch.ops.fp8core_engine.linear(x, bias, layer_key)``, which TorchDynamo records as one opaque node (its shape
from the fake kernel below) and which at run time looks the layer up by ``layer_key`` and runs the layer's own
forward (rollout/vllm_fp8.py: ``Fp8CoreLinearMethod.forward``) -- the same code as an eager engine, so a traced
engine gives the eager engine's bits. The experts methods (rollout/vllm_fp8.py, rollout/vllm_bf16.py) call
``torch.ops.fp8core_engine.experts(x, topk_weights, topk_ids, layer_key)`` the same way.

Why a key, not the weight tensors as arguments: a traced graph that took the layer's tensors as constants would
keep the tensors of the load it was traced on, and vLLM's single trace never re-checks them, while a refit replaces
them (the CPU op's packed weight is rebuilt per refit). The key is a constant string; the layer's current tensors
are read when the op runs, so the traced model sees every refit. (vLLM's attention op finds its layer by name the
same way.) Inside a CUDA graph the op's Python does not run again at replay: there the kernels it captured read the
layer's parameters, which vLLM's reload refits in place (same storage); docs/performance.md says what waits for a
GPU.

Keys are ``<engine>/<prefix>``: ``<engine>`` numbers the quantization configs of this process (one per engine), so
two engines in one process (tests, the mismatch diagnostics) never share a layer. The registry holds layers weakly:
a shut-down engine's layers go with it.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from fp8core.quant import NonFiniteInput, record_nonfinite

__all__ = ["engine_key", "experts", "layer_of", "linear", "register_layer"]

# key -> (the layer, weakly; its forward: (layer, x, bias) -> y)
_LAYERS: dict[str, tuple[weakref.ref, Callable]] = {}
_ENGINES = itertools.count()


def engine_key() -> str:
    """A new engine's part of its layers' keys."""
    return f"engine{next(_ENGINES)}"


def register_layer(key: str, layer: torch.nn.Module, forward: Callable) -> None:
    """Make ``layer`` callable through the ops as ``key``: ``forward(layer, *tensors)`` computes it (``x, bias`` for
    :func:`linear`, ``x, topk_weights, topk_ids`` for :func:`experts`)."""
    _LAYERS[key] = (weakref.ref(layer, lambda _ref, key=key: _LAYERS.pop(key, None)), forward)


def layer_of(key: str) -> tuple[torch.nn.Module, Callable]:
    entry = _LAYERS.get(key)
    layer = entry[0]() if entry is not None else None
    if layer is None:
        raise KeyError(f"fp8core_engine: no live layer {key!r} (its engine was shut down?)")
    return layer, entry[1]


def _finite_or_flagged(run: Callable[[], torch.Tensor], x: torch.Tensor, width: int) -> torch.Tensor:
    """``run()``, or where its FP8 quantizer met non-finite input: NaN ``[..., width]`` and the device's flag set
    (fp8core.quant.record_nonfinite), not an exception -- on any device. The engine checks the flag after each
    generation and clears it at start-up (vLLM's warm-up of a compiled model runs on uninitialized buffers); off
    the CPU the quantizer never reads the device, so the flag is all there is."""
    try:
        return run()
    except NonFiniteInput:
        record_nonfinite(x.device)
        return x.new_full((*x.shape[:-1], width), float("nan"))


@torch.library.custom_op("fp8core_engine::linear", mutates_args=())
def linear(x: torch.Tensor, bias: torch.Tensor | None, layer_key: str) -> torch.Tensor:
    """The FP8 layer ``layer_key``'s output for ``x`` (``[..., K]`` -> ``[..., N]`` in x's dtype)."""
    layer, forward = layer_of(layer_key)
    return _finite_or_flagged(lambda: forward(layer, x, bias), x, layer.output_size_per_partition)


@linear.register_fake
def _(x: torch.Tensor, bias: torch.Tensor | None, layer_key: str) -> torch.Tensor:
    layer, _forward = layer_of(layer_key)
    return x.new_empty((*x.shape[:-1], layer.output_size_per_partition))


@torch.library.custom_op("fp8core_engine::experts", mutates_args=())
def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: str) -> torch.Tensor:
    """The routed experts of MoE layer ``layer_key`` for ``x`` ``[T, H]`` and its routing (``[T, k]`` weights and
    expert ids) -> ``[T, H]`` in x's dtype."""
    layer, forward = layer_of(layer_key)
    return _finite_or_flagged(lambda: forward(layer, x, topk_weights, topk_ids), x, x.shape[-1])


@experts.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: str) -> torch.Tensor:
    return torch.empty_like(x)
