"""A served FP8 refit copied straight into the engine's parameters, without vLLM's layerwise reload.

vLLM's ``reload_weights`` restores every layer's checkpoint layout first (our FP8 layers stage their weight in
FP32), loads into it, runs ``process_weights_after_loading`` and copies the result back into the kernel tensors:
for an FP8 layer that is the codes widened to FP32, checked, narrowed again and copied. A served refit already
carries the kernel form -- the trainer's FP8 codes and ``weight_scale_inv`` per HF tensor -- so this loader copies
each tensor into its partition's rows of the layer's own ``weight`` / ``weight_scale_inv`` (same storage: what a
traced or graph-captured engine reads), then rebuilds only what the GEMM reads from them (the CPU op's packed
weight, the emulation's dequantized one; nothing for scaled_mm) once per layer, when its last partition is in.
The tensors outside the FP8 layers (embeddings, norms, the output projection, BF16-kept layers on vLLM's own
unquantized method) go through the model's own ``load_weights``, which copies in place too.

It applies when every name of the refit has such a home (:func:`plan` says so up front, from the names alone);
anything else -- FP32 masters to an engine that quantizes them itself, MoE experts, layers on a staged method (the
emulated BF16 ones, the FP32 router), a model vLLM runs in other processes -- keeps vLLM's reload, which handles
every form. Both give the same parameters bit for bit (tests/rollout/test_refit_contract.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout.checkpoint import SCALE_SUFFIX


def _fp8_method(module: torch.nn.Module):
    from rollout.vllm_fp8 import Fp8CoreLinearMethod

    method = getattr(module, "quant_method", None)
    return method if isinstance(method, Fp8CoreLinearMethod) else None


def _loads_as_is(module: torch.nn.Module) -> bool:
    """A module whose parameters vLLM's own loaders fill in place and use as loaded: no quant method (norms) or
    vLLM's unquantized linear / embedding methods (not a staged subclass)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return True
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return type(method) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def _resolve(modules: dict[str, torch.nn.Module], packed: dict[str, list[str]], name: str
             ) -> tuple[str, torch.nn.Module, int | None] | None:
    """An HF parameter name's module in the vLLM model and its partition there (q/k/v of qkv_proj, gate/up of
    gate_up_proj through the model's ``packed_modules_mapping``; None when unfused), or None."""
    prefix, _, _leaf = name.rpartition(".")
    if prefix in modules:
        return prefix, modules[prefix], None
    parent, _, sub = prefix.rpartition(".")
    for fused, parts in packed.items():
        if sub in parts and f"{parent}.{fused}" in modules:
            return f"{parent}.{fused}", modules[f"{parent}.{fused}"], parts.index(sub)
    return None


class InPlaceRefit:
    """One refit's in-place load (module docstring): :meth:`load` per bucket of (name, tensor) items, in any order
    and split anywhere; :meth:`finish` once, which fails if an FP8 layer did not get every partition."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, tuple[str, torch.nn.Module, int | None]]):
        self.model = model
        self.targets = targets  # FP8-layer names only; the rest goes to model.load_weights
        self.pending: dict[str, set[tuple[int, str]]] = {}

    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        plain = []
        for name, tensor in items:
            target = self.targets.get(name)
            if target is None:
                plain.append((name, tensor))
                continue
            key, module, part = target
            method = _fp8_method(module)
            is_scale = name.endswith(SCALE_SUFFIX)
            method.copy_partition(module, part or 0, **({"scale": tensor} if is_scale else {"codes": tensor}))
            todo = self.pending.setdefault(key, {(i, kind) for i in range(len(module.logical_widths))
                                                 for kind in ("codes", "scale")})
            todo.discard((part or 0, "scale" if is_scale else "codes"))
            if not todo:
                method._prepare_gemm(module)
                self.pending[key] = set()
        if plain:
            self.model.load_weights(iter(plain))

    def finish(self) -> None:
        if partial := sorted(key for key, todo in self.pending.items() if todo):
            raise RuntimeError(f"refit: FP8 layers {partial[:3]} did not receive every partition's codes and "
                               "scales; their weights are mixed until the next complete refit")


def plan(model: torch.nn.Module, names: Iterable[str]) -> InPlaceRefit | None:
    """An :class:`InPlaceRefit` for a refit carrying ``names`` (HF names: FP8 codes + ``weight_scale_inv`` for the
    FP8 layers, high precision for the rest), or None where any name needs vLLM's reload (module docstring)."""
    modules = dict(model.named_modules())
    packed = dict(getattr(type(model), "packed_modules_mapping", None) or {})
    names = set(names)
    targets = {}
    for name in names:
        found = _resolve(modules, packed, name)
        if found is None:
            return None
        _key, module, _part = found
        if _fp8_method(module) is not None:
            weight = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
            if weight + SCALE_SUFFIX not in names or not weight.endswith(".weight"):
                return None  # high-precision weights for an FP8 layer: it quantizes them itself (vLLM's reload)
            targets[name] = found
        elif not _loads_as_is(module):
            return None
    return InPlaceRefit(model, targets)
