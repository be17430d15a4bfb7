"""Out-of-tree vLLM quantization method ``fp8core_block``: blockwise FP8 linears with fp8core's numerics.

Why our own method: vLLM's ``quantization="fp8"`` does not run on CPU (its ops are CUDA stubs) and its block-FP8
CPU path needs AMX; and even on GPU its quantizer is not ours. Rollouts and training must share numerics, so the
rollout engine quantizes and multiplies exactly as the trainer's :class:`fp8core.linear.FP8Linear` does.

What it does per linear layer (``LinearBase``: qkv_proj, o_proj, gate_up_proj, down_proj of the FP8 decoder layers):

* ``create_weights``: an FP32 staging ``weight`` in checkpoint layout ``[N, K]`` (FP32 so that FP32 master weights
  pushed at refit are quantized without a detour through BF16; BF16 checkpoints upcast exactly).
* ``process_weights_after_loading`` (at load and at every ``reload_weights`` refit -- vLLM's layerwise reload puts the
  checkpoint layout back, loads into it, calls this, and copies the result into the kernel tensors in place):
  each logical output partition (q / k / v of the fused qkv_proj, gate / up of gate_up_proj) is quantized on its own
  with ``fp8core.quantize(w, "block128", fmt="e4m3", pow2=pow2_weight)``, which is exactly what the trainer does to
  the separate HF ``q_proj`` / ``k_proj`` / ... weights. The layer then holds ``weight`` (float8_e4m3fn ``[N, K]``)
  and ``weight_scale_inv`` (FP32 dequantization scales, the partitions' ``[ceil(n_i/128), ceil(K/128)]`` blocks
  stacked along dim 0 -- the same layout as vLLM's block-FP8 checkpoints when every n_i is a multiple of 128) and
  ``weight_block_size = [128, 128]``.
* ``apply``: ``fp8core.linear.fp8_linear_forward(x, weight_q_i, bias_i, recipe="blockwise",
  pow2_activation=...)`` per partition, concatenated along the output dim: activations quantized E4M3 in 1x128
  groups per token at run time, FP32 accumulation, BF16 out. Per partition because the trainer runs q/k/v (and
  gate/up) as separate GEMMs: same operands, same per-output-column dot products.

Which path runs where: fp8core's ``backend="auto"`` -- on CPU (and GPUs without FP8 tensor cores) the emulation
(dequantize -> FP32 matmul), on CUDA devices with capability >= 8.9 ``torch._scaled_mm`` over 128-wide K chunks. The
trainer's FP8Linear uses the same rule, so the two sides use the same backend on the same hardware. vLLM's own
block-FP8 CUDA kernels (``quantization="fp8"`` with ``weight_block_size``) are not used: they quantize activations
with their own kernel, so they would not be bit-identical to training.

Which layers: decoder layers ``fp8core.convert.fp8_layer_indices(L, first, last)`` (the trainer's rule); the first
``num_first_layers_in_bf16`` and last ``num_last_layers_in_bf16`` decoder layers, embeddings, lm_head and norms stay
in BF16 (vLLM's unquantized method). Attention (and the KV cache) is not touched here: FP8 KV is vLLM's
``kv_cache_dtype="fp8"`` with scales set by workers/rollout.py.

Configuration travels inside the HF config (``hf_overrides={"quantization_config": quantization_config_dict(...)}``)
with ``quantization="fp8core_block"``; importing this module registers the method (in-process engines only: with
vLLM multiprocessing the engine process would have to import it too, e.g. through a vLLM general plugin).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter

from fp8core.convert import fp8_layer_indices
from fp8core.linear import fp8_linear_forward
from fp8core.quant import GROUP, QuantizedTensor, quantize

QUANT_NAME = "fp8core_block"
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_KEYS = ("num_hidden_layers", "num_first_layers_in_bf16", "num_last_layers_in_bf16",
         "pow2_weight_scaling_factors", "pow2_activation_scaling_factors")


def quantization_config_dict(*, num_hidden_layers: int, num_first_layers_in_bf16: int = 0,
                             num_last_layers_in_bf16: int = 0, pow2_weight_scaling_factors: bool = False,
                             pow2_activation_scaling_factors: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` entry to put in the HF config (through ``hf_overrides``) for ``fp8core_block``."""
    cfg = {"quant_method": QUANT_NAME, "num_hidden_layers": num_hidden_layers,
           "num_first_layers_in_bf16": num_first_layers_in_bf16, "num_last_layers_in_bf16": num_last_layers_in_bf16,
           "pow2_weight_scaling_factors": pow2_weight_scaling_factors,
           "pow2_activation_scaling_factors": pow2_activation_scaling_factors, "weight_block_size": [GROUP, GROUP]}
    Fp8CoreBlockConfig.from_config(cfg)  # validate now, with the key names in the message
    return cfg


@register_quantization_config(QUANT_NAME)
class Fp8CoreBlockConfig(QuantizationConfig):
    """Blockwise FP8 (128x128 weights, 1x128 activations) computed by fp8core; see the module docstring."""

    def __init__(self, *, num_hidden_layers: int, num_first_layers_in_bf16: int = 0, num_last_layers_in_bf16: int = 0,
                 pow2_weight_scaling_factors: bool = False, pow2_activation_scaling_factors: bool = False):
        super().__init__()
        self.fp8_layers = frozenset(fp8_layer_indices(num_hidden_layers, num_first_layers_in_bf16,
                                                      num_last_layers_in_bf16))
        self.num_hidden_layers = num_hidden_layers
        self.pow2_weight = pow2_weight_scaling_factors
        self.pow2_activation = pow2_activation_scaling_factors
        self.weight_block_size = [GROUP, GROUP]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8CoreBlockConfig:
        unknown = set(config) - set(_KEYS) - {"quant_method", "weight_block_size"}
        if unknown:
            raise ValueError(f"quantization_config for {QUANT_NAME} has unknown keys {sorted(unknown)}")
        if "num_hidden_layers" not in config:
            raise ValueError(f"quantization_config for {QUANT_NAME} lacks 'num_hidden_layers'")
        if config.get("weight_block_size", [GROUP, GROUP]) != [GROUP, GROUP]:
            raise ValueError(f"quantization_config.weight_block_size must be [128, 128], "
                             f"got {config['weight_block_size']}")
        for key in ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"quantization_config.{key} must be a bool, got {config[key]!r}")
        return cls(**{k: config[k] for k in _KEYS if k in config})

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # pure torch: runs anywhere (FP8 GEMMs on capability >= 89, emulation elsewhere)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    def layer_index(self, prefix: str) -> int | None:
        m = _LAYER_RE.search(prefix)
        return int(m.group(1)) if m else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head, attention: unquantized (KV cache dtype is set separately)
        idx = self.layer_index(prefix)
        if idx is None or idx not in self.fp8_layers:
            return UnquantizedLinearMethod()
        return Fp8CoreBlockLinearMethod(self)


class Fp8CoreBlockLinearMethod(LinearMethodBase):
    """Quantize at load/refit with fp8core (128x128, per logical partition); run fp8core's FP8 forward."""

    def __init__(self, config: Fp8CoreBlockConfig):
        self.config = config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = sum(output_partition_sizes)
        layer.orig_dtype = params_dtype
        layer.weight_block_size = [GROUP, GROUP]
        weight = ModelWeightParameter(
            data=torch.empty(layer.output_size_per_partition, input_size_per_partition, dtype=torch.float32),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.get("weight_loader"))
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        if w.dtype == torch.float8_e4m3fn:  # already processed (no new weights were loaded)
            return
        datas, scales = [], []
        offset = 0
        for width in layer.logical_widths:
            q = quantize(w[offset:offset + width], "block128", fmt="e4m3", pow2=self.config.pow2_weight)
            datas.append(q.data)
            scales.append(q.scale)
            offset += width
        layer.weight = Parameter(torch.cat(datas, 0), requires_grad=False)
        layer.weight_scale_inv = Parameter(torch.cat(scales, 0).to(torch.float32), requires_grad=False)

    def partitions(self, layer: torch.nn.Module) -> list[QuantizedTensor]:
        """The layer's FP8 weight as one QuantizedTensor per logical partition (views, no copies)."""
        out, row, srow = [], 0, 0
        for width in layer.logical_widths:
            nblk = -(-width // GROUP)
            out.append(QuantizedTensor(layer.weight[row:row + width], layer.weight_scale_inv[srow:srow + nblk],
                                       "block128", "e4m3"))
            row += width
            srow += nblk
        return out

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        parts = self.partitions(layer)
        ys, row = [], 0
        for wq in parts:
            n = wq.data.shape[0]
            b = None if bias is None else bias[row:row + n]
            ys.append(fp8_linear_forward(x, wq, b, recipe="blockwise",
                                         pow2_activation=self.config.pow2_activation))
            row += n
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
