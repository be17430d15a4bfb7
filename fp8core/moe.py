"""Mixture-of-Experts in FP8: expert projections on fp8core's FP8 GEMMs, the router in FP32, routing replay.

Layout (transformers 5.x Qwen3-MoE, ``Qwen3MoeExperts``): per decoder layer ``mlp.experts.gate_up_proj
[E, 2I, H]`` (gate rows ``[:I]`` then up rows ``[I:]`` of each expert) and ``mlp.experts.down_proj [E, H, I]``;
the router ``mlp.gate.weight [E, H]`` with ``top_k`` and ``norm_topk_prob``. Checkpoints (save_pretrained, vLLM)
name the experts one by one: ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (:func:`checkpoint_state_dict`).

What runs in FP8 (the FP8 decoder layers of :func:`fp8core.convert.fp8_layer_indices`): each expert's gate, up and
down projection is its own FP8 linear -- gate and up quantized as *separate* partitions (as the dense ``gate_proj``
/ ``up_proj``), 128x128 weight blocks per expert for the blockwise recipe (rowwise / tensorwise per expert matrix
otherwise), activations quantized at run time as for :class:`fp8core.linear.FP8Linear` (same autograd function,
so dgrad / wgrad are FP8 too). What stays high precision: the router, norms, embeddings, lm_head.

The router computes its logits in FP32 (``F.linear(h.float(), W.float())``, NeMo RL's ``moe_router_dtype: fp32``)
and routes as vLLM's CPU router does (``vllm/model_executor/layers/fused_moe/router/cpu_router.py``): top-k over
the logits, then the weights ``softmax(top-k logits)`` when ``norm_topk_prob`` (mathematically HF's softmax +
renormalisation), else ``exp(logit - logsumexp(all logits))``. Same logits -> same experts and bit-identical
weights on both sides.

:func:`experts_forward` is the one expert loop both sides run (trainer: :class:`FP8Experts`; engine:
rollout/vllm_fp8.py's MoE method): experts in ascending id, each on its tokens, ``act(gate) * up``, down,
times the routing weight (FP32), accumulated with ``index_add_`` in the input dtype.

Routing replay (R3): :class:`FP32Router` can be told the experts to use (``forced_ids``, e.g. the rollout engine's
top-k per token); it then routes every token to those experts with weights recomputed from its *own* logits (so the
router still gets gradients) and records the experts it would have chosen itself (``last_own_ids``) for
``moe/routing_mismatch_frac``.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fp8core.layers import decoder_layers
from fp8core.linear import FP8LinearConfig, WeightCache, _FP8LinearFunction
from fp8core.quant import QuantizedTensor

__all__ = ["FP32Router", "FP8Experts", "checkpoint_state_dict", "convert_experts", "convert_routers",
           "experts_forward", "expert_load_stats", "forced_routing", "is_experts", "is_router", "moe_blocks",
           "route", "routing_mismatch_frac"]

PARTS = ("gate", "up", "down")
_FUSED = re.compile(r"^(?P<pre>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def route(logits: torch.Tensor, *, top_k: int, renormalize: bool,
          forced_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights FP32 [T, k], expert ids int64 [T, k]) from router logits [T, E] (computed in FP32 here).

    Top-k over the logits (``torch.topk(sorted=False)``, as vLLM's CPU router); ``forced_ids`` replaces the choice
    (routing replay) and the weights are taken from these logits at the forced experts."""
    logits = logits.float()
    if forced_ids is None:
        vals, ids = torch.topk(logits, k=top_k, dim=-1, sorted=False)
    else:
        ids = forced_ids.to(device=logits.device, dtype=torch.long)
        if ids.shape != (*logits.shape[:-1], top_k):
            raise ValueError(f"route: forced_ids of shape {tuple(ids.shape)}, expected {(*logits.shape[:-1], top_k)}")
        vals = logits.gather(-1, ids)
    if renormalize:
        w = torch.softmax(vals, dim=-1)
    else:
        w = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    return w.to(torch.float32), ids.to(torch.long)


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, num_experts: int,
                    linear: Callable[[torch.Tensor, int, str], torch.Tensor],
                    act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """``sum_k weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = ids[t, k]``; x [T, H].

    ``linear(x_e, e, part)`` computes one projection (part: gate | up | down) of expert ``e``. Experts run in
    ascending id on the rows routed to them; products are scaled by the FP32 routing weight and added into an
    output of x's dtype (``index_add_``), so the order of additions is fixed."""
    out = torch.zeros_like(x)
    flat = ids.reshape(ids.shape[0], -1)
    for e in torch.unique(flat).tolist():
        if not 0 <= e < num_experts:
            raise ValueError(f"experts_forward: expert id {e} outside [0, {num_experts})")
        token_idx, pos = torch.where(flat == e)
        xe = x[token_idx]
        h = act(linear(xe, e, "gate")) * linear(xe, e, "up")
        y = linear(h, e, "down") * weights[token_idx, pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def is_experts(module: nn.Module) -> bool:
    """A fused experts module: 3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` parameters."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
            and gu.shape[0] == dn.shape[0] and gu.shape[1] == 2 * dn.shape[2] and gu.shape[2] == dn.shape[1])


def is_router(module: nn.Module) -> bool:
    """A top-k router: a ``weight [E, H]`` parameter and ``top_k`` / ``num_experts`` attributes."""
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(module, "top_k")
            and w.shape[0] == getattr(module, "num_experts", -1))


class FP8Experts(nn.Module):
    """Fused experts whose projections run fp8core's FP8 GEMMs per expert (module docstring). Shares the original
    ``gate_up_proj`` / ``down_proj`` Parameters (state_dict keys, optimizer state unchanged). ``config=None`` or
    ``fp8_enabled = False``: the same loop in high precision (``F.linear``)."""

    def __init__(self, experts: nn.Module, config: FP8LinearConfig | None):
        super().__init__()
        if not is_experts(experts):
            raise ValueError(f"FP8Experts: {type(experts).__name__} is not a fused experts module")
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.num_experts = experts.gate_up_proj.shape[0]
        self.intermediate = experts.down_proj.shape[2]
        self.act_fn = getattr(experts, "act_fn", F.silu)
        self.config = config
        self.fp8_enabled = config is not None
        self._caches: dict[tuple[int, str], WeightCache] = {}

    def weight(self, e: int, part: str) -> torch.Tensor:
        """Expert ``e``'s ``part`` (gate | up | down) weight [N, K]: a view of the fused Parameter."""
        i = self.intermediate
        if part == "gate":
            return self.gate_up_proj[e, :i]
        if part == "up":
            return self.gate_up_proj[e, i:]
        if part == "down":
            return self.down_proj[e]
        raise ValueError(f"FP8Experts.weight: part must be one of {PARTS}, got {part!r}")

    def _linear(self, x: torch.Tensor, e: int, part: str) -> torch.Tensor:
        w = self.weight(e, part)
        if not self.fp8_enabled or self.config is None:
            return F.linear(x, w)
        return _FP8LinearFunction.apply(x, w, None, self.config, None)

    def quantized_weight(self, e: int, part: str) -> QuantizedTensor:
        """The forward FP8 weight of expert ``e``'s ``part`` (what a serving engine holds)."""
        if self.config is None:
            raise ValueError("FP8Experts.quantized_weight: this layer is not FP8 (config=None)")
        return WeightCache().get(self.weight(e, part), self.config)[0]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(hidden_states, top_k_index, top_k_weights, num_experts=self.num_experts,
                               linear=self._linear, act=self.act_fn)

    def extra_repr(self) -> str:
        c = self.config
        return (f"num_experts={self.num_experts}, intermediate={self.intermediate}, "
                f"recipe={None if c is None else c.recipe}, fp8_enabled={self.fp8_enabled}")


class FP32Router(nn.Module):
    """Top-k router with FP32 logits and optional routing replay (module docstring). Shares the original
    ``weight`` Parameter. Returns ``(logits FP32, weights FP32, ids)`` like transformers' Qwen3MoeTopKRouter."""

    def __init__(self, router: nn.Module):
        super().__init__()
        if not is_router(router):
            raise ValueError(f"FP32Router: {type(router).__name__} is not a top-k router")
        self.weight = router.weight
        self.top_k = int(router.top_k)
        self.num_experts = int(router.num_experts)
        self.norm_topk_prob = bool(getattr(router, "norm_topk_prob", True))
        self.forced_ids: torch.Tensor | None = None  # [T, k] for the next forward (routing replay)
        self.last_own_ids: torch.Tensor | None = None  # [T, k] the experts this router chose itself
        self.last_ids: torch.Tensor | None = None  # [T, k] the experts used (forced or own)

    def forward(self, hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, self.weight.shape[1])
        logits = F.linear(h.float(), self.weight.float())
        with torch.no_grad():
            self.last_own_ids = torch.topk(logits, k=self.top_k, dim=-1, sorted=False)[1].detach()
        weights, ids = route(logits, top_k=self.top_k, renormalize=self.norm_topk_prob, forced_ids=self.forced_ids)
        self.last_ids = ids.detach()
        return logits, weights, ids


def moe_blocks(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """(decoder layer index, mlp) for every decoder layer whose ``mlp`` has a fused experts module and a router."""
    _, layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate") and (
                is_experts(mlp.experts)) and (is_router(mlp.gate) or isinstance(mlp.gate, FP32Router)):
            yield i, mlp


def convert_routers(model: nn.Module) -> list[int]:
    """Swap every MoE router for an :class:`FP32Router` (in place; idempotent); returns the layer indices."""
    out = []
    for i, mlp in moe_blocks(model):
        if not isinstance(mlp.gate, FP32Router):
            mlp.gate = FP32Router(mlp.gate)
        out.append(i)
    return out


def convert_experts(model: nn.Module, config: FP8LinearConfig, layer_indices: list[int]) -> list[str]:
    """Swap the fused experts of the given decoder layers for :class:`FP8Experts` with ``config`` (in place);
    returns their dotted names. Layers without experts are skipped."""
    prefix, _ = decoder_layers(model)
    wanted, out = set(layer_indices), []
    for i, mlp in moe_blocks(model):
        if i not in wanted:
            continue
        if isinstance(mlp.experts, FP8Experts):
            mlp.experts.config, mlp.experts.fp8_enabled = config, True
        else:
            mlp.experts = FP8Experts(mlp.experts, config)
        out.append(f"{prefix}.{i}.mlp.experts")
    return out


def routers(model: nn.Module) -> list[tuple[int, FP32Router]]:
    return [(i, mlp.gate) for i, mlp in moe_blocks(model) if isinstance(mlp.gate, FP32Router)]


@contextlib.contextmanager
def forced_routing(model: nn.Module, ids: dict[int, torch.Tensor] | None):
    """Inside the block, MoE layer ``i`` routes the flattened tokens of the next forwards to ``ids[i]`` ([T, k]);
    ``None`` = no replay. Restored on exit."""
    rs = routers(model)
    try:
        for i, r in rs:
            r.forced_ids = None if ids is None else ids[i]
        yield model
    finally:
        for _, r in rs:
            r.forced_ids = None


def routing_mismatch_frac(own: torch.Tensor, other: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Fraction of tokens whose top-k expert *set* differs between ``own`` and ``other`` ([T, k]); ``mask`` [T]
    selects the tokens that count."""
    a, _ = own.sort(dim=-1)
    b, _ = other.to(own.device, own.dtype).sort(dim=-1)
    diff = (a != b).any(dim=-1)
    if mask is not None:
        diff = diff[mask.reshape(-1).bool()]
    return float(diff.float().mean()) if diff.numel() else 0.0


def expert_load_stats(ids: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Load balance of the routed (token, expert) pairs ``ids`` [T, k]: ``max`` / ``min`` = the busiest / idlest
    expert's share over the uniform share (1.0 = balanced), ``cv`` = coefficient of variation of the counts."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts).float()
    mean = counts.mean()
    if float(mean) == 0:
        return {"max": 0.0, "min": 0.0, "cv": 0.0}
    return {"max": float(counts.max() / mean), "min": float(counts.min() / mean),
            "cv": float(counts.std(unbiased=False) / mean)}


def checkpoint_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every fused ``<...>.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` split into the
    checkpoint names ``<...>.experts.<e>.{gate,up,down}_proj.weight`` (views); other entries unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _FUSED.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        pre = m["pre"]
        if m["kind"] == "gate_up_proj":
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = t[e, :i]
                out[f"{pre}.{e}.up_proj.weight"] = t[e, i:]
        else:
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = t[e]
    return out
