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

MoE experts likewise: each expert's gate / up / down codes and scales into its rows of the layer's ``w13`` / ``w2``,
the packed experts rebuilt once the layer's last one is in; the FP32 router loads in place through its own loader.

It applies when every name of the refit has such a home (:func:`plan` says so up front, from the names alone);
anything else -- FP32 masters to an engine that quantizes them itself, layers on a staged method (the emulated BF16
ones) -- keeps vLLM's reload, which handles every form. Both give the same parameters bit for bit
(tests/rollout/test_refit_contract.py, tests/rollout/test_vllm_fp8_moe.py).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from rollout.checkpoint import SCALE_SUFFIX

_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def _method(module: torch.nn.Module):
    """The module's method where this loader copies into it (the FP8 linears and experts, the BF16 experts: they
    declare ``refit_kinds``), else None."""
    method = getattr(module, "quant_method", None)
    return method if hasattr(method, "refit_kinds") else None


def _loads_as_is(module: torch.nn.Module) -> bool:
    """A module whose parameters vLLM's loaders fill in place and use as loaded: no quant method (norms), vLLM's
    unquantized linear / embedding methods (not a staged subclass), the FP32 router (its staging is its weight)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return True
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from rollout.vllm_bf16 import Fp32GateLinearMethod

    return type(method) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, Fp32GateLinearMethod)


class _Target(NamedTuple):
    key: str  # the module's name: its GEMM form is rebuilt once every piece of ``needs`` is in
    module: torch.nn.Module
    piece: tuple  # (partition,) of a dense layer, (expert, projection) of an experts layer
    needs: frozenset  # every (piece..., "weight" | "scale") the module takes


def _resolve(modules: dict[str, torch.nn.Module], packed: dict[str, list[str]], weight: str) -> _Target | None:
    """An HF weight name's module in the vLLM model and its piece there: the partition of a fused layer (q/k/v of
    qkv_proj, gate/up of gate_up_proj through the model's ``packed_modules_mapping``; 0 when unfused) or the expert
    and projection of an experts layer; None where the model has no such module."""
    if (m := _EXPERT.match(weight)) and m["layer"] in modules:
        module = next((sub for sub in modules[m["layer"]].modules() if hasattr(sub, "w13_weight")), None)
        if module is None:
            return None
        n = module.w13_weight.shape[0]
        kinds = getattr(module.quant_method, "refit_kinds", ())
        needs = frozenset((e, p, k) for e in range(n) for p in ("gate", "up", "down") for k in kinds)
        return _Target(m["layer"], module, (int(m["e"]), m["proj"]), needs)
    prefix = weight.rpartition(".")[0]
    key, part = (prefix, 0) if prefix in modules else (None, None)
    if key is None:
        parent, _, sub = prefix.rpartition(".")
        for fused, parts in packed.items():
            if sub in parts and f"{parent}.{fused}" in modules:
                key, part = f"{parent}.{fused}", parts.index(sub)
                break
        else:
            return None
    module = modules[key]
    widths, kinds = getattr(module, "logical_widths", None) or [0], getattr(_method(module), "refit_kinds", ())
    return _Target(key, module, (part,), frozenset((i, k) for i in range(len(widths)) for k in kinds))


class InPlaceRefit:
    """One refit's in-place load (module docstring): :meth:`load` per bucket of (name, tensor) items, in any order
    and split anywhere; :meth:`finish` once, which fails if an FP8 layer did not get every piece."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, _Target]):
        self.model = model
        self.targets = targets  # the FP8 layers' names only; the rest goes to model.load_weights
        self.pending: dict[str, set] = {}

    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        plain = []
        for name, tensor in items:
            target = self.targets.get(name)
            if target is None:
                plain.append((name, tensor))
                continue
            kind = "scale" if name.endswith(SCALE_SUFFIX) else "weight"
            method = _method(target.module)
            copy = method.copy_expert if len(target.piece) == 2 else method.copy_partition
            copy(target.module, *target.piece, **{kind: tensor})
            todo = self.pending.setdefault(target.key, set(target.needs))
            todo.discard((*target.piece, kind))
            if not todo:
                method.prepare_gemm(target.module)
        if plain:
            self.model.load_weights(iter(plain))

    def finish(self) -> None:
        if partial := sorted(key for key, todo in self.pending.items() if todo):
            raise RuntimeError(f"refit: FP8 layers {partial[:3]} did not receive every piece's codes and scales; "
                               "their weights are mixed until the next complete refit")


def plan(model: torch.nn.Module, names: Iterable[str]) -> InPlaceRefit | None:
    """An :class:`InPlaceRefit` for a refit carrying ``names`` (HF names: FP8 codes + ``weight_scale_inv`` for the
    FP8 layers, high precision for the rest), or None where any name needs vLLM's reload (module docstring)."""
    modules = dict(model.named_modules())
    packed = dict(getattr(type(model), "packed_modules_mapping", None) or {})
    names = set(names)
    targets = {}
    for name in names:
        weight = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        target = _resolve(modules, packed, weight)
        if target is None:
            return None
        if (method := _method(target.module)) is not None:
            if not weight.endswith(".weight") or ("scale" in method.refit_kinds) != (weight + SCALE_SUFFIX in names):
                return None  # high-precision weights for an FP8 layer: it quantizes them itself (vLLM's reload)
            targets[name] = target
        elif not _loads_as_is(target.module):
            return None
    return InPlaceRefit(model, targets)


def loader(llm, names: Iterable[str], *, in_place: bool = True) -> tuple[Callable, Callable, str]:
    """``(load(items), finish(), which)`` for a refit carrying ``names`` into the vLLM engine ``llm`` (in this
    process): the in-place copy where :func:`plan` finds a home for every name (``which`` = ``"in_place"``), else
    vLLM's layerwise ``reload_weights`` (``"vllm_reload"``; it also takes FP32 masters and every staged method);
    ``in_place=False`` (``refit_loader: vllm_reload``) always the latter."""
    inplace = llm.apply_model(lambda model: plan(model, names))[0] if in_place else None
    if inplace is None:
        def reload(items) -> None:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})

        return reload, lambda: None, "vllm_reload"
    return (lambda items: llm.apply_model(lambda _model: inplace.load(items))), inplace.finish, "in_place"
