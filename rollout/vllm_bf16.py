"""Out-of-tree vLLM linear method ``bf16_emulated``: BF16 linears computed as FP32 GEMMs on BF16-valued operands.

Why: on CPUs without BF16 dot-product units (AVX2-only machines) vLLM's BF16 linears convert element by element;
the BF16 rollout ran 560 tokens/s there while the FP8 rollout -- whose linears are FP32 GEMMs on dequantized
operands (rollout/vllm_fp8.py) -- ran 1,100 (measured on an AVX2-only machine). A BF16 GEMM's numerics are fixed by its
operands: BF16 inputs, FP32 accumulation, one rounding of the result to BF16. With the engine in ``dtype=bfloat16``
the activations reaching a linear are already BF16; this method keeps each weight as an FP32 tensor holding its
BF16 rounding (``fp8core.bf16.round_bf16``, torch's round-to-nearest-even cast -- the value vLLM's own BF16 weight
would hold) and computes ``(x.float() @ w.T).to(bfloat16)``: BF16 numerics at FP32 GEMM speed, the same structure
as the FP8 method. With ``dtype=float32`` engines the activations are rounded to BF16 first and the result is kept
FP32 with BF16 values.

Scope: every ``LinearBase`` (qkv_proj, o_proj, gate_up_proj, down_proj) except a MoE router (``mlp.gate``),
which stays FP32 with FP32 logits (:class:`Fp32GateLinearMethod`); MoE experts run :class:`Bf16EmulatedMoEMethod`
(the same per-expert loop as fp8core.moe, BF16-valued FP32 GEMMs). Why our own experts method even where BF16 is
native: vLLM 0.32's unquantized CPU MoE does not survive ``reload_weights`` (measured: greedy tokens of the same
weights changed after a refit of those very weights), so a MoE rollout engine always uses this config. Embeddings, ``lm_head``, norms and
attention are vLLM's own (BF16 in a BF16 engine). Refits (``reload_weights``) re-run
``process_weights_after_loading``, which re-rounds the FP32 weights received.

Use: ``import rollout.vllm_bf16`` (registers the method) and pass ``quantization="bf16_emulated"`` with
``hf_overrides={"quantization_config": quantization_config_dict()}`` to ``vllm.LLM`` (``dtype="bfloat16"``).
When to use it: the rollout's BF16 precision on CPUs without BF16 units (``fp8core.cpu.cpu_caps().native_bf16``
false), where it is the same rule as the trainer's ``policy.bf16_mode: auto``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase, FusedMoEQuantConfig, RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter

from fp8core.bf16 import round_bf16
from fp8core.moe import experts_forward
from rollout.engine_ops import engine_key, register_layer

QUANT_NAME = "bf16_emulated"


def quantization_config_dict() -> dict[str, Any]:
    """The ``quantization_config`` entry to put in the HF config (through ``hf_overrides``)."""
    return {"quant_method": QUANT_NAME}


def engine_kwargs() -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments that turn the method on (add to the engine's own; dtype stays bfloat16)."""
    return {"quantization": QUANT_NAME, "hf_overrides": {"quantization_config": quantization_config_dict()}}


@register_quantization_config(QUANT_NAME)
class Bf16EmulatedConfig(QuantizationConfig):
    """BF16 linears as FP32 GEMMs on BF16-valued operands; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.engine = engine_key()  # this engine's part of its experts' op keys (rollout/engine_ops.py)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Bf16EmulatedConfig:
        unknown = set(config) - {"quant_method"}
        if unknown:
            raise ValueError(f"quantization_config for {QUANT_NAME} has unknown keys {sorted(unknown)}")
        return cls()

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            return Bf16EmulatedMoEMethod(layer.moe_config, f"{self.engine}/{prefix}")
        if not isinstance(layer, LinearBase):
            return None
        return Fp32GateLinearMethod() if is_moe_gate(prefix) else Bf16EmulatedLinearMethod()


def is_moe_gate(prefix: str) -> bool:
    """Whether a linear is a Mixture-of-Experts router (``...mlp.gate``; dense MLPs have ``gate_up_proj``)."""
    return prefix.endswith("mlp.gate")


class Fp32StagedLinearMethod(LinearMethodBase):
    """A linear method whose checkpoint / refit tensors load into an FP32 ``weight`` (:func:`stage_fp32_weight`);
    subclasses turn it into their kernel form in ``process_weights_after_loading``."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        stage_fp32_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                          extra_weight_attrs.get("weight_loader"))


class Fp32GateLinearMethod(Fp32StagedLinearMethod):
    """A MoE router in FP32: the weight staged and kept in FP32, ``F.linear(x.float(), w)`` -> FP32 logits (the
    trainer's fp8core.moe.FP32Router). Used by this method and rollout/vllm_fp8.py for ``mlp.gate``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x.to(torch.float32), layer.weight, None if bias is None else bias.to(torch.float32))


def stage_fp32_weight(layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                      params_dtype: torch.dtype, weight_loader) -> None:
    """The layer attributes vLLM's linears expect and an FP32 ``weight`` ``[N, K]`` that checkpoint / refit tensors
    load into (FP32, so FP32 masters arrive unrounded); ``process_weights_after_loading`` turns it into the kernel
    form. Shared by this method and rollout/vllm_fp8.py."""
    layer.logical_widths = list(output_partition_sizes)
    layer.input_size_per_partition = input_size_per_partition
    layer.output_size_per_partition = sum(output_partition_sizes)
    layer.orig_dtype = params_dtype
    weight = ModelWeightParameter(
        data=torch.empty(layer.output_size_per_partition, input_size_per_partition, dtype=torch.float32),
        input_dim=1, output_dim=0, weight_loader=weight_loader)
    layer.register_parameter("weight", weight)


class Bf16EmulatedLinearMethod(Fp32StagedLinearMethod):
    """FP32 weight holding BF16 values; ``apply`` = FP32 GEMM, result rounded to BF16."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        layer.weight = Parameter(round_bf16(w.to(torch.float32)), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.to(torch.float32) if x.dtype != torch.float32 else round_bf16(x)
        b = None if bias is None else round_bf16(bias.to(torch.float32))
        y = F.linear(xf, layer.weight, b)
        return y.to(x.dtype) if x.dtype != torch.float32 else round_bf16(y)


# --------------------------------------------------------------------------------------------------- MoE experts
_W13_SHARDS = {"w1": 0, "w3": 1}  # gate, up


def expert_loader(layer: torch.nn.Module, kind: str, *, scale_rows=None):
    """vLLM's expert weight-loader protocol (``param.weight_loader(param=, loaded_weight=, weight_name=, shard_id=,
    expert_id=, return_success=)``): one expert's gate (w1) / up (w3) / down (w2) weight -- or, with
    ``scale_rows(i)`` (where partition i's scales sit), its scales -- into the FP32 staging tensor. Records what
    was loaded in ``layer.fp8core_weights_loaded`` / ``layer.fp8core_scales_loaded``."""
    inter = layer.fp8core_inter

    def load(param: Parameter, loaded_weight: torch.Tensor, weight_name: str = "", shard_id: str | None = None,
             expert_id: int | None = None, return_success: bool = False):
        i = _W13_SHARDS[shard_id] if kind == "w13" else 0
        if scale_rows is not None:
            dst = param.data[expert_id][scale_rows(i)]
        elif kind == "w13":
            dst = param.data[expert_id, i * inter:(i + 1) * inter]
        else:
            dst = param.data[expert_id]
        if tuple(loaded_weight.shape) != tuple(dst.shape):
            raise ValueError(f"{weight_name} (expert {expert_id}, shard {shard_id}): shape "
                             f"{tuple(loaded_weight.shape)}, the layer needs {tuple(dst.shape)}")
        dst.copy_(loaded_weight.to(torch.float32))
        loaded = layer.fp8core_scales_loaded if scale_rows is not None else layer.fp8core_weights_loaded
        loaded.add((kind, expert_id, i))
        return True if return_success else None

    return load


def stage_expert_weights(layer: torch.nn.Module, num_experts: int, hidden_size: int, inter: int) -> None:
    """FP32 staging ``w13_weight [E, 2I, H]`` (gate rows, then up rows) and ``w2_weight [E, H, I]`` with the expert
    loader; shared with rollout/vllm_fp8.py."""
    layer.fp8core_inter = inter
    layer.fp8core_weights_loaded, layer.fp8core_scales_loaded = set(), set()
    for kind, shape in (("w13", (2 * inter, hidden_size)), ("w2", (hidden_size, inter))):
        w = Parameter(torch.zeros(num_experts, *shape, dtype=torch.float32), requires_grad=False)
        w.weight_loader = expert_loader(layer, kind)
        layer.register_parameter(f"{kind}_weight", w)


class Bf16EmulatedMoEMethod(FusedMoEMethodBase):
    """Experts in BF16 numerics with our loop (fp8core.moe.experts_forward): each expert's gate / up / down as an
    FP32 weight holding its BF16 rounding, ``F.linear(x.float(), w)`` rounded to x's dtype (a BF16 GEMM's result).
    Re-rounds at every load / refit."""

    def __init__(self, moe: FusedMoEConfig, key: str):
        super().__init__(moe)
        self.key = key  # the layer's name for the engine's experts op (rollout/engine_ops.py)
        self.record_routing = False
        self.last_topk_ids: torch.Tensor | None = None

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        stage_expert_weights(layer, num_experts, hidden_size, intermediate_size_per_partition)
        register_layer(self.key, layer, self.forward)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        loaded, layer.fp8core_weights_loaded = layer.fp8core_weights_loaded, set()
        if not loaded and getattr(layer, "fp8core_rounded", False):
            return
        # the rounded weights replace the staging as the layer's parameters (one FP32 copy, not two; vLLM's reload
        # copies a refit's into these very tensors)
        layer.w13_weight = Parameter(round_bf16(layer.w13_weight.data), requires_grad=False)
        layer.w2_weight = Parameter(round_bf16(layer.w2_weight.data), requires_grad=False)
        layer.fp8core_rounded = True

    refit_kinds = ("weight",)  # what an in-place refit brings per piece (rollout/inplace_refit.py)

    def copy_expert(self, layer: torch.nn.Module, e: int, proj: str, *, weight: torch.Tensor) -> None:
        """A refit's expert ``e`` projection ``proj`` (gate / up / down) copied in place into its rows of the
        layer's weights, BF16-rounded as :meth:`process_weights_after_loading` rounds (rollout/inplace_refit.py)."""
        inter = layer.fp8core_inter
        dst = (layer.w2_weight.data[e] if proj == "down" else
               layer.w13_weight.data[e, :inter] if proj == "gate" else layer.w13_weight.data[e, inter:])
        if tuple(weight.shape) != tuple(dst.shape):
            raise ValueError(f"expert {e} {proj}: {tuple(weight.shape)}, the layer holds {tuple(dst.shape)}")
        dst.copy_(round_bf16(weight.to(torch.float32)))

    def prepare_gemm(self, layer: torch.nn.Module) -> None:
        """Nothing beyond the rounded weights themselves (the dense FP8 / experts methods rebuild their packed form
        here)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return torch.ops.fp8core_engine.experts(x, topk_weights, topk_ids, self.key)

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output (what :meth:`apply` asks the engine's op for)."""
        if self.record_routing:
            self.last_topk_ids = topk_ids.detach().to(torch.int16).cpu().clone()
        xf = x.to(torch.float32) if x.dtype != torch.float32 else round_bf16(x)

        inter, w13, w2 = layer.fp8core_inter, layer.w13_weight, layer.w2_weight

        def linear(v: torch.Tensor, e: int, part: str) -> torch.Tensor:
            w = w2[e] if part == "down" else w13[e, :inter] if part == "gate" else w13[e, inter:]
            y = F.linear(v.to(torch.float32), w)
            return y.to(x.dtype) if x.dtype != torch.float32 else round_bf16(y)

        return experts_forward(xf.to(x.dtype) if x.dtype != torch.float32 else xf, topk_ids, topk_weights,
                               num_experts=w2.shape[0], linear=linear, act=F.silu)
