"""Out-of-tree vLLM linear method ``bf16_emulated``: BF16 linears computed as FP32 GEMMs on BF16-valued operands.

Why: on CPUs without BF16 dot-product units (AVX2-only machines) vLLM's BF16 linears convert element by element;
the BF16 rollout ran 560 tokens/s there while the FP8 rollout -- whose linears are FP32 GEMMs on dequantized
operands (workers/vllm_fp8.py) -- ran 1,100 (DESIGN.md "Facts measured"). A BF16 GEMM's numerics are fixed by its
operands: BF16 inputs, FP32 accumulation, one rounding of the result to BF16. With the engine in ``dtype=bfloat16``
the activations reaching a linear are already BF16; this method keeps each weight as an FP32 tensor holding its
BF16 rounding (``fp8core.bf16.round_bf16``, torch's round-to-nearest-even cast -- the value vLLM's own BF16 weight
would hold) and computes ``(x.float() @ w.T).to(bfloat16)``: BF16 numerics at FP32 GEMM speed, the same structure
as the FP8 method. With ``dtype=float32`` engines the activations are rounded to BF16 first and the result is kept
FP32 with BF16 values.

Scope: every ``LinearBase`` (qkv_proj, o_proj, gate_up_proj, down_proj). Embeddings, ``lm_head``, norms and
attention are vLLM's own (BF16 in a BF16 engine). Refits (``reload_weights``) re-run
``process_weights_after_loading``, which re-rounds the FP32 weights received.

Use: ``import workers.vllm_bf16`` (registers the method) and pass ``quantization="bf16_emulated"`` with
``hf_overrides={"quantization_config": quantization_config_dict()}`` to ``vllm.LLM`` (``dtype="bfloat16"``).
When to use it: the rollout's BF16 precision on CPUs without BF16 units (``fp8core.cpu.cpu_caps().native_bf16``
false), where it is the same rule as the trainer's ``policy.bf16_mode: auto``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter

from fp8core.bf16 import round_bf16

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
        return Bf16EmulatedLinearMethod() if isinstance(layer, LinearBase) else None


def stage_fp32_weight(layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                      params_dtype: torch.dtype, weight_loader) -> None:
    """The layer attributes vLLM's linears expect and an FP32 ``weight`` ``[N, K]`` that checkpoint / refit tensors
    load into (FP32, so FP32 masters arrive unrounded); ``process_weights_after_loading`` turns it into the kernel
    form. Shared by this method and workers/vllm_fp8.py."""
    layer.logical_widths = list(output_partition_sizes)
    layer.input_size_per_partition = input_size_per_partition
    layer.output_size_per_partition = sum(output_partition_sizes)
    layer.orig_dtype = params_dtype
    weight = ModelWeightParameter(
        data=torch.empty(layer.output_size_per_partition, input_size_per_partition, dtype=torch.float32),
        input_dim=1, output_dim=0, weight_loader=weight_loader)
    layer.register_parameter("weight", weight)


class Bf16EmulatedLinearMethod(LinearMethodBase):
    """FP32 weight holding BF16 values; ``apply`` = FP32 GEMM, result rounded to BF16."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        stage_fp32_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                          extra_weight_attrs.get("weight_loader"))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        layer.weight = Parameter(round_bf16(w.to(torch.float32)), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.to(torch.float32) if x.dtype != torch.float32 else round_bf16(x)
        b = None if bias is None else round_bf16(bias.to(torch.float32))
        y = F.linear(xf, layer.weight, b)
        return y.to(x.dtype) if x.dtype != torch.float32 else round_bf16(y)
