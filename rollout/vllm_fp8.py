"""Out-of-tree vLLM quantization method ``fp8core``: FP8 linears with fp8core's numerics, for every trainer recipe
(blockwise, rowwise, tensorwise).

Why our own method: vLLM's ``quantization="fp8"`` does not run on CPU (its ops are CUDA stubs) and its block-FP8
CPU path needs AMX; and even on GPU its quantizer is not ours. Rollouts and training must share numerics, so the
rollout engine quantizes and multiplies exactly as the trainer's :class:`fp8core.linear.FP8Linear` does, in the
trainer's recipe.

What it does per linear layer (``LinearBase``: qkv_proj, o_proj, gate_up_proj, down_proj of the FP8 decoder layers):

* ``create_weights``: an FP32 staging ``weight`` in checkpoint layout ``[N, K]`` (FP32 so that FP32 master weights
  pushed at refit are quantized without a detour through BF16; BF16 checkpoints upcast exactly).
* ``process_weights_after_loading`` (at load and at every ``reload_weights`` refit -- vLLM's layerwise reload puts the
  checkpoint layout back, loads into it, calls this, and copies the result into the kernel tensors in place):
  each logical output partition (q / k / v of the fused qkv_proj, gate / up of gate_up_proj) is quantized on its own
  with ``fp8core.quantize(w, weight_granularity(recipe), fmt="e4m3", pow2=pow2_weight)``, which is exactly what the
  trainer does to the separate HF ``q_proj`` / ``k_proj`` / ... weights. The layer then holds ``weight``
  (float8_e4m3fn ``[N, K]``) and ``weight_scale_inv`` (FP32 dequantization scales of the partitions, stacked):

  ===========  =============================================  ======================================================
  recipe       weight granularity                             ``weight_scale_inv``
  ===========  =============================================  ======================================================
  blockwise    128x128 blocks                                 ``[sum_i ceil(n_i/128), ceil(K/128)]`` (vLLM's block-FP8
                                                              layout when every n_i is a multiple of 128);
                                                              ``weight_block_size = [128, 128]``
  rowwise      one scale per output row                       ``[N, 1]``
  tensorwise   one scale per partition (= per HF tensor)      ``[num_partitions]`` (vLLM's per-tensor FP8 layout
                                                              before it requantizes fused layers to one max)
  ===========  =============================================  ======================================================
* ``apply``: one call of the engine's op ``fp8core_engine::linear`` (rollout/engine_ops.py: compilable), which runs
  ``Fp8CoreLinearMethod.forward``: the activation quantized E4M3 once at run time with the recipe's activation
  granularity (1x128 groups per token / one scale per token / one scale per tensor), then the backend's GEMMs over
  the partitions (side by side on the CPU op and the emulation, one per partition on scaled_mm), FP32 accumulation,
  BF16 out. The trainer runs q/k/v (and gate/up) as separate GEMMs: same operands, same per-output-column dot
  products.

Identity with the trainer: the engine's FP8 weights after refit equal the trainer's ``FP8Linear.quantized_weight()``
bit for bit, and for the same input tensor the engine's linear outputs equal the trainer's (tested per recipe). For
blockwise and rowwise activations every scale depends on one token only, so a token's output is the same whether
vLLM packs it with other requests or the trainer pads it into a micro-batch. **Tensorwise activations are not
token-local**: the scale is the amax over all tokens of the GEMM, and vLLM's packed batch is not the trainer's padded
micro-batch, so end-to-end identity of whole sequences cannot hold for tensorwise (it does for the same tensor).

Which path runs where: fp8core's ``backend="auto"`` -- on CPU (and GPUs without FP8 tensor cores) the emulation
(dequantize -> FP32 matmul), on CUDA devices with capability >= 8.9 ``torch._scaled_mm``. The trainer's FP8Linear
uses the same rule, so the two sides use the same backend on the same hardware. vLLM's own FP8 CUDA kernels are not
used: they quantize activations with their own kernel, so they would not be bit-identical to training.

Which layers: decoder layers ``fp8core.convert.fp8_layer_indices(L, first, last)`` (the trainer's rule); the first
``num_first_layers_in_bf16`` and last ``num_last_layers_in_bf16`` decoder layers, embeddings, lm_head and norms stay
in BF16 (vLLM's unquantized method). Attention (and the KV cache) is not touched here: FP8 KV is vLLM's
``kv_cache_dtype="fp8"`` with scales set by rollout/kv_cache.py.

Mixture-of-Experts (Qwen3-MoE; fp8core/moe.py has the numerics): the routed experts (vLLM's ``RoutedExperts``) of
the FP8 decoder layers get :class:`Fp8CoreMoEMethod`, a pure-torch ``FusedMoEMethodBase``: FP32 staging
``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` (checkpoint names ``experts.<e>.{gate,up,down}_proj.weight``,
plus ``weight_scale_inv`` for a pre-quantized refit), each expert's gate, up and down quantized on its own with the
recipe's weight granularity (as the trainer's :class:`fp8core.moe.FP8Experts`); the codes and scales then replace the
staging as the layer's parameters (the FP32 staging exists only while a layer loads or refits), and
``apply(x, topk_weights, topk_ids)`` = :func:`fp8core.moe.experts_forward` on the layer's backend (the CPU op, the
emulation or scaled_mm) -- the trainer's loop and GEMMs.
The router (``mlp.gate``, a vLLM linear) is never quantized: :class:`Fp32GateLinearMethod` keeps its weight in FP32
and returns FP32 logits, which vLLM's CPU router turns into top-k exactly as :func:`fp8core.moe.route` does. The
experts of BF16-kept layers use rollout/vllm_bf16.py's experts method (vLLM's own CPU MoE does not survive a
refit). Both experts methods run through the engine's op ``fp8core_engine::experts``. Optionally
(``record_routing``) the method keeps the last forward's ``topk_ids`` per layer (routing replay, rollout/routing.py).

Configuration travels inside the HF config (``hf_overrides={"quantization_config": quantization_config_dict(...)}``)
with ``quantization="fp8core"``; importing this module registers the method (in-process engines only: with
vLLM multiprocessing the engine process would have to import it too, e.g. through a vLLM general plugin).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase, FusedMoEQuantConfig, RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from configs.schema import FP8_RECIPE_KEYS, fp8_spec_from_keys, fp8_spec_keys
from fp8core.linear import (
    fp8_linear_forward,
    fp8_linear_forward_cpu,
    fp8_linear_forward_emulated,
    fp8_linear_forward_partitions,
    pack_weight,
    resolve_backend,
)
from fp8core.moe import experts_forward
from fp8core.quant import GROUP, GROUP_SIZES, QuantizedTensor, dequantize, quantize
from fp8core.spec import FP8Spec
from rollout.engine_ops import engine_key, register_layer
from rollout.vllm_bf16 import (
    Bf16EmulatedMoEMethod,
    Fp32GateLinearMethod,
    Fp32StagedLinearMethod,
    expert_loader,
    is_moe_gate,
    stage_expert_weights,
)

QUANT_NAME = "fp8core"
_SCALE = "_weight_scale_inv"
_BACKEND_KEY = "fp8core_backend"  # the GEMM backend (FP8Spec.backend) when it is not auto
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
def quantization_config_dict(*, num_hidden_layers: int, backend: str = "auto", **recipe_keys: Any) -> dict[str, Any]:
    """The ``quantization_config`` entry to put in the HF config (through ``hf_overrides``) for ``fp8core``: an
    ``fp8core.spec.FP8Spec``'s forward numerics under the recipe's key names (``configs.schema.FP8_RECIPE_KEYS``;
    ``fp8_spec_keys(spec)`` gives them), absent keys at FP8Spec's defaults; a ``backend`` other than auto (the
    trainer's ``fp8_cfg.backend``) as ``fp8core_backend``."""
    spec = fp8_spec_from_keys(recipe_keys, where="quantization_config", backend=backend)
    unknown = set(recipe_keys) - set(FP8_RECIPE_KEYS)
    if unknown:
        raise ValueError(f"quantization_config for {QUANT_NAME} has unknown keys {sorted(unknown)}")
    cfg = {"quant_method": QUANT_NAME, "num_hidden_layers": num_hidden_layers, **fp8_spec_keys(spec)}
    if spec.backend != "auto":
        cfg[_BACKEND_KEY] = spec.backend
    if spec.recipe == "blockwise":
        cfg["weight_block_size"] = [GROUP, GROUP]
    Fp8CoreConfig.from_config(cfg)  # validate now, with the key names in the message
    return cfg


@register_quantization_config(QUANT_NAME)
class Fp8CoreConfig(QuantizationConfig):
    """FP8 linears computed by fp8core with one ``FP8Spec``'s numerics (``spec``); see the module docstring."""

    def __init__(self, *, num_hidden_layers: int, spec: FP8Spec):
        super().__init__()
        self.spec = spec
        self.fp8_layers = frozenset(spec.layer_indices(num_hidden_layers))
        self.num_hidden_layers = num_hidden_layers
        self.recipe = spec.recipe
        self.weight_granularity = spec.weight_granularity
        self.pow2_weight = spec.pow2_weight
        self.pow2_activation = spec.pow2_activation
        self.weight_block_size = [GROUP, GROUP] if spec.recipe == "blockwise" else None
        self.engine = engine_key()  # this engine's part of its layers' op keys (rollout/engine_ops.py)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8CoreConfig:
        unknown = (set(config) - set(FP8_RECIPE_KEYS)
                   - {"quant_method", "weight_block_size", "num_hidden_layers", _BACKEND_KEY})
        if unknown:
            raise ValueError(f"quantization_config for {QUANT_NAME} has unknown keys {sorted(unknown)}")
        if "num_hidden_layers" not in config:
            raise ValueError(f"quantization_config for {QUANT_NAME} lacks 'num_hidden_layers'")
        recipe = config.get("fp8_recipe", "blockwise")
        expected_block = [GROUP, GROUP] if recipe == "blockwise" else None
        if config.get("weight_block_size", expected_block) != expected_block:
            raise ValueError(f"quantization_config.weight_block_size must be {expected_block} for "
                             f"fp8_recipe={recipe!r}, got {config['weight_block_size']}")
        spec = fp8_spec_from_keys({k: v for k, v in config.items() if k in FP8_RECIPE_KEYS},
                                  where="quantization_config", backend=config.get(_BACKEND_KEY, "auto"))
        return cls(num_hidden_layers=config["num_hidden_layers"], spec=spec)

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
        if isinstance(layer, RoutedExperts):
            idx = self.layer_index(prefix)
            if idx is None or idx not in self.fp8_layers:
                # a BF16-kept layer (vLLM's own MoE fails refits)
                return Bf16EmulatedMoEMethod(layer.moe_config, f"{self.engine}/{prefix}")
            return Fp8CoreMoEMethod(self, layer.moe_config, f"{self.engine}/{prefix}")
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head, attention: unquantized (KV cache dtype is set separately)
        if is_moe_gate(prefix):
            return Fp32GateLinearMethod()  # the router: high precision, FP32 logits
        idx = self.layer_index(prefix)
        if idx is None or idx not in self.fp8_layers:
            return UnquantizedLinearMethod()
        return Fp8CoreLinearMethod(self, prefix)


def _scale_rows(granularity: str, widths: list[int], i: int) -> slice | int:
    """Where partition ``i``'s scales sit in ``weight_scale_inv`` (rows for block128 / rowwise / group32, an index
    for tensorwise)."""
    if granularity == "tensorwise":
        return i
    size = (lambda n: -(-n // GROUP)) if granularity == "block128" else (lambda n: n)
    start = sum(size(n) for n in widths[:i])
    return slice(start, start + size(widths[i]))


def _scale_shape(granularity: str, widths: list[int], k: int) -> tuple[int, ...]:
    if granularity == "tensorwise":
        return (len(widths),)
    if granularity == "rowwise":
        return (sum(widths), 1)
    if granularity in GROUP_SIZES:  # mxfp8's group32: 1x32 groups along K per row
        return (sum(widths), -(-k // GROUP_SIZES[granularity]))
    return (sum(-(-n // GROUP) for n in widths), -(-k // GROUP))


_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def _copy_served(held: QuantizedTensor, weight: torch.Tensor | None, scale: torch.Tensor | None, what: str) -> None:
    """A served refit's FP8 codes (float8 or their bytes) and / or scales copied into ``held``, a piece of a layer
    as views of its parameters (a dense layer's partition, an expert's projection; rollout/inplace_refit.py)."""
    if weight is not None:
        if tuple(weight.shape) != tuple(held.data.shape):
            raise ValueError(f"{what}: codes {tuple(weight.shape)}, the layer holds {tuple(held.data.shape)}")
        held.data.view(torch.uint8).copy_(weight.view(torch.uint8))
    if scale is not None:
        if scale.numel() != held.scale.numel():
            raise ValueError(f"{what}: {scale.numel()} scales, the {held.granularity} layout holds "
                             f"{held.scale.numel()}")
        held.scale.copy_(scale.reshape(held.scale.shape))


def _scale_loader(layer: torch.nn.Module, granularity: str):
    """Weight loader of ``weight_scale_inv``: one partition's scales (HF ``<proj>.weight_scale_inv``, shard id q/k/v
    or 0/1 from vLLM's stacked-parameter mapping, none for unfused layers) into that partition's rows."""

    def load(param: Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        i = 0 if shard_id is None else _SHARD_INDEX.get(shard_id, shard_id)
        dst = param.data[_scale_rows(granularity, layer.logical_widths, i)]
        if tuple(loaded.shape) != tuple(dst.shape):
            raise ValueError(f"weight_scale_inv of partition {shard_id!r}: shape {tuple(loaded.shape)}, the "
                             f"{granularity} layout needs {tuple(dst.shape)}")
        dst.copy_(loaded.to(torch.float32))
        layer.fp8core_scales_loaded.add(i)

    return load


class Fp8CoreLinearMethod(Fp32StagedLinearMethod):
    """Quantize at load/refit with fp8core (per logical partition, the recipe's weight granularity), or take
    pre-quantized FP8 codes + scales as they are; run fp8core's FP8 forward."""

    def __init__(self, config: Fp8CoreConfig, prefix: str):
        self.config = config
        self.key = f"{config.engine}/{prefix}"  # the layer's name for the engine's op (rollout/engine_ops.py)
        from fp8core import kernels

        kernels.load()  # the fused quantize kernel (built once per CPU kind, logged) before the first forward

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, **extra_weight_attrs)
        layer.weight_block_size = self.config.weight_block_size
        # Pre-quantized checkpoints (an FP8 export, an FP8 refit) also bring ``<proj>.weight_scale_inv`` per
        # partition; ``weight`` then stages the FP8 codes (exact in FP32) and nothing is re-quantized.
        gran = self.config.weight_granularity
        scale = Parameter(torch.ones(_scale_shape(gran, layer.logical_widths, input_size_per_partition),
                                     dtype=torch.float32), requires_grad=False)
        scale.weight_loader = _scale_loader(layer, gran)
        layer.register_parameter("weight_scale_inv", scale)
        layer.fp8core_scales_loaded = set()
        register_layer(self.key, layer, self.forward)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        if w.dtype == torch.float8_e4m3fn:  # already processed (no new weights were loaded)
            return
        loaded, layer.fp8core_scales_loaded = layer.fp8core_scales_loaded, set()
        gran = self.config.weight_granularity
        if loaded:  # FP8 codes + their scales: keep them bit for bit
            if len(loaded) != len(layer.logical_widths):
                raise ValueError(f"pre-quantized weights: scales for partitions {sorted(loaded)} of "
                                 f"{len(layer.logical_widths)} were loaded; an FP8 checkpoint needs all of them")
            data = w.to(torch.float8_e4m3fn)
            if not torch.equal(data.to(torch.float32), w):
                raise ValueError("pre-quantized weights: weight_scale_inv was given but the weight values are not "
                                 "FP8 (e4m3) codes")
            layer.weight = Parameter(data, requires_grad=False)
            layer.weight_scale_inv = Parameter(layer.weight_scale_inv.data, requires_grad=False)
            self.prepare_gemm(layer)
            return
        datas, scales = [], []
        offset = 0
        for width in layer.logical_widths:
            q = quantize(w[offset:offset + width], gran, fmt="e4m3", pow2=self.config.pow2_weight)
            datas.append(q.data)
            scales.append(q.scale.reshape(1) if q.scale.dim() == 0 else q.scale)
            offset += width
        layer.weight = Parameter(torch.cat(datas, 0), requires_grad=False)
        layer.weight_scale_inv = Parameter(torch.cat(scales, 0).to(torch.float32), requires_grad=False)
        self.prepare_gemm(layer)

    def prepare_gemm(self, layer: torch.nn.Module) -> None:
        """What ``apply`` reads, computed once per load / refit: for the CPU FP8 GEMM the partitions' codes packed
        side by side with their scales per row and K block (``fp8core.gemm.PackedWeight``: 2 bytes per weight on
        CPUs with BF16 units, 4 without, + ~1/32 of a byte of scales); for the emulation the partitions' FP32
        dequantized weights side by side (4 bytes per weight, kept only when emulating); nothing for scaled_mm (it
        reads the codes). Side by side, ``apply`` quantizes the activation once and runs one GEMM for q/k/v
        (gate/up) instead of one per partition: each column is the same dot product."""
        layer.fp8core_backend = backend = resolve_backend(self.config.spec.backend, layer.weight.device)
        parts = self.partitions(layer)
        layer.fp8core_weight_dq = torch.cat([dequantize(q) for q in parts], 0) if backend == "emulated" else None
        layer.fp8core_packed = pack_weight(parts, self.config.recipe) if backend == "cpu" else None

    refit_kinds = ("weight", "scale")  # what an in-place refit brings per piece (rollout/inplace_refit.py)

    def copy_partition(self, layer: torch.nn.Module, i: int, *, weight: torch.Tensor | None = None,
                       scale: torch.Tensor | None = None) -> None:
        """A served refit's partition ``i`` (its FP8 codes, as float8 or their bytes, and/or its ``weight_scale_inv``)
        copied in place into the layer's rows of ``weight`` / ``weight_scale_inv`` (rollout/inplace_refit.py); the
        GEMM's form follows with :meth:`prepare_gemm` once every partition is in."""
        _copy_served(self.partitions(layer)[i], weight, scale, f"partition {i}")

    def partitions(self, layer: torch.nn.Module) -> list[QuantizedTensor]:
        """The layer's FP8 weight as one QuantizedTensor per logical partition (views, no copies)."""
        gran = self.config.weight_granularity
        out, row = [], 0
        for i, width in enumerate(layer.logical_widths):
            scale = layer.weight_scale_inv[_scale_rows(gran, layer.logical_widths, i)]
            out.append(QuantizedTensor(layer.weight[row:row + width], scale, gran, "e4m3"))
            row += width
        return out

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """One call of the engine's op (rollout/engine_ops.py), which runs :meth:`forward`: a traced (compiled) model
        records it as one node and reads the layer's current weights whenever it runs."""
        return torch.ops.fp8core_engine.linear(x, bias, self.key)

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's FP8 output: the activation quantized once for all partitions (q/k/v, gate/up), then the
        backend's GEMMs -- one over the partitions side by side on the CPU op and the emulation (each column is the
        same dot product), one per partition on scaled_mm (the trainer's GEMM shapes, so the same kernels)."""
        recipe, pow2_act = self.config.recipe, self.config.pow2_activation
        if layer.fp8core_backend == "cpu":
            return fp8_linear_forward_cpu(x, layer.fp8core_packed, bias, recipe=recipe, pow2_activation=pow2_act)
        if layer.fp8core_backend == "emulated":
            return fp8_linear_forward_emulated(x, layer.fp8core_weight_dq, bias, recipe=recipe,
                                               pow2_activation=pow2_act)
        return fp8_linear_forward_partitions(x, self.partitions(layer), bias, recipe=recipe, pow2_activation=pow2_act,
                                             backend=layer.fp8core_backend)


# --------------------------------------------------------------------------------------------------- memory
def _tensors(value) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (a tensor, a PackedWeight or another tuple, a list, a dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def fp8_layer_memory(model: torch.nn.Module) -> dict:
    """What the engine's FP8 layers hold: ``fp8_params`` (their weights' element count), ``bytes`` (every tensor
    they hold -- parameters, buffers and the method's own tensors: codes, scales, packed weights, dequantized
    copies -- each storage counted once), ``layers`` and their GEMM ``backends``. ``bytes / fp8_params`` is ~1
    (codes + scales) on the scaled_mm path, 1 + 2 (or + 4 without BF16 units) with the CPU op's packed copy, 5 when
    emulating."""
    fp8_params = nbytes = layers = 0
    backends = set()
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if not isinstance(method, (Fp8CoreLinearMethod, Fp8CoreMoEMethod)):
            continue
        layers += 1
        backends.add(m.fp8core_backend)
        fp8_params += (m.weight if isinstance(method, Fp8CoreLinearMethod) else m.w13_weight).numel()
        if isinstance(method, Fp8CoreMoEMethod):
            fp8_params += m.w2_weight.numel()
        held = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        held += [t for v in vars(m).values() for t in _tensors(v)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t.numel()}
        nbytes += sum(storages.values())
    return {"fp8_params": fp8_params, "bytes": nbytes, "layers": layers, "backends": sorted(backends)}


# --------------------------------------------------------------------------------------------------- MoE experts
class Fp8CoreMoEMethod(FusedMoEMethodBase):
    """Experts of one MoE layer in fp8core FP8 (module docstring): per expert and projection quantized at
    load / refit (or FP8 codes + scales taken as they are), the trainer's expert loop at run time."""

    def __init__(self, config: Fp8CoreConfig, moe: FusedMoEConfig, key: str):
        super().__init__(moe)
        self.config = config
        self.key = key  # the layer's name for the engine's experts op (rollout/engine_ops.py)
        self.record_routing = False
        self.last_topk_ids: torch.Tensor | None = None
        from fp8core import kernels

        kernels.load()

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        inter, gran = intermediate_size_per_partition, self.config.weight_granularity
        stage_expert_weights(layer, num_experts, hidden_size, inter)
        register_layer(self.key, layer, self.forward)
        # pre-quantized refits / exports also bring <expert>.<proj>.weight_scale_inv per expert and projection
        for kind, widths, k in (("w13", [inter, inter], hidden_size), ("w2", [hidden_size], inter)):
            sc = Parameter(torch.ones(num_experts, *_scale_shape(gran, widths, k), dtype=torch.float32),
                           requires_grad=False)
            sc.weight_loader = expert_loader(layer, kind, scale_rows=lambda i, w=widths: _scale_rows(gran, w, i))
            layer.register_parameter(f"{kind}{_SCALE}", sc)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    def expert_weights(self, layer: torch.nn.Module, e: int) -> dict[str, QuantizedTensor]:
        """Expert ``e``'s FP8 gate / up / down as the engine holds them (views of the layer's parameters)."""
        inter, gran = layer.fp8core_inter, self.config.weight_granularity
        w13, w2 = layer.w13_weight, layer.w2_weight
        sc13, sc2 = getattr(layer, f"w13{_SCALE}")[e], getattr(layer, f"w2{_SCALE}")[e]
        return {"gate": QuantizedTensor(w13[e, :inter], sc13[_scale_rows(gran, [inter, inter], 0)], gran, "e4m3"),
                "up": QuantizedTensor(w13[e, inter:], sc13[_scale_rows(gran, [inter, inter], 1)], gran, "e4m3"),
                "down": QuantizedTensor(w2[e], sc2[_scale_rows(gran, [w2.shape[1]], 0)], gran, "e4m3")}

    refit_kinds = ("weight", "scale")  # what an in-place refit brings per piece (rollout/inplace_refit.py)

    def copy_expert(self, layer: torch.nn.Module, e: int, proj: str, *, weight: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> None:
        """A served refit's expert ``e`` projection ``proj`` (gate / up / down: its FP8 codes, as float8 or their
        bytes, and/or its ``weight_scale_inv``) copied in place into the layer's ``w13`` / ``w2`` rows
        (rollout/inplace_refit.py); the GEMM's form follows with :meth:`prepare_gemm` once every expert is in."""
        _copy_served(self.expert_weights(layer, e)[proj], weight, scale, f"expert {e} {proj}")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weights, scales = layer.fp8core_weights_loaded, layer.fp8core_scales_loaded
        layer.fp8core_weights_loaded, layer.fp8core_scales_loaded = set(), set()
        if not weights and layer.w13_weight.dtype == torch.float8_e4m3fn:
            return  # nothing new was loaded
        inter, gran, pow2 = layer.fp8core_inter, self.config.weight_granularity, self.config.pow2_weight
        out = {}
        for kind, widths in (("w13", [inter, inter]), ("w2", [layer.w2_weight.shape[1]])):
            w, sc = getattr(layer, f"{kind}_weight").data, getattr(layer, f"{kind}{_SCALE}").data
            if scales:  # pre-quantized (FP8 refit / export): codes + scales kept bit for bit
                if scales != weights:
                    raise ValueError(f"pre-quantized experts: scales for {len(scales)} of {len(weights)} expert "
                                     "weights were loaded; an FP8 refit needs all of them")
                data = w.to(torch.float8_e4m3fn)
                if not torch.equal(data.to(torch.float32), w):
                    raise ValueError("pre-quantized experts: weight_scale_inv was given but the expert weights are "
                                     "not FP8 (e4m3) codes")
                out[kind] = (data, sc.clone())
                continue
            datas, all_scales = [], []
            for e in range(w.shape[0]):
                parts, row, ss = [], 0, []
                for width in widths:
                    q = quantize(w[e, row:row + width], gran, fmt="e4m3", pow2=pow2)
                    parts.append(q.data)
                    ss.append(q.scale.reshape(1) if q.scale.dim() == 0 else q.scale)
                    row += width
                datas.append(torch.cat(parts, 0))
                all_scales.append(torch.cat(ss, 0))
            out[kind] = (torch.stack(datas), torch.stack(all_scales).to(torch.float32))
        # the codes and scales replace the FP32 staging as the layer's parameters: the staging is gone after the
        # load (vLLM's reload re-creates it per layer while refitting, then copies the codes and scales into these
        # very tensors: stable storage)
        for kind in ("w13", "w2"):
            data, sc = out[kind]
            setattr(layer, f"{kind}_weight", Parameter(data, requires_grad=False))
            setattr(layer, f"{kind}{_SCALE}", Parameter(sc, requires_grad=False))
        self.prepare_gemm(layer)

    def prepare_gemm(self, layer: torch.nn.Module) -> None:
        """What ``forward`` reads besides the codes, once per load / refit: the GEMM backend; the emulation's FP32
        weights only when emulating, dequantized once (same values as per forward); the CPU op's packed weights."""
        layer.fp8core_backend = backend = resolve_backend(self.config.spec.backend, layer.w13_weight.device)
        experts = [self.expert_weights(layer, e) for e in range(layer.w13_weight.shape[0])]
        layer.fp8core_dq = ([{p: dequantize(q) for p, q in ws.items()} for ws in experts] if backend == "emulated"
                            else None)
        # the CPU FP8 GEMM: each expert's projections packed once per load / refit, as the dense layers
        layer.fp8core_packed = ([{p: pack_weight(q, self.config.recipe) for p, q in ws.items()} for ws in experts]
                                if backend == "cpu" else None)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return torch.ops.fp8core_engine.experts(x, topk_weights, topk_ids, self.key)

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output (what :meth:`apply` asks the engine's op for): the trainer's expert loop on the
        layer's backend."""
        if self.record_routing:
            self.last_topk_ids = topk_ids.detach().to(torch.int16).cpu().clone()
        recipe, pow2_act = self.config.recipe, self.config.pow2_activation

        def linear(v: torch.Tensor, e: int, part: str) -> torch.Tensor:
            if layer.fp8core_packed is not None:
                return fp8_linear_forward_cpu(v, layer.fp8core_packed[e][part], None, recipe=recipe,
                                              pow2_activation=pow2_act)
            if layer.fp8core_dq is not None:
                return fp8_linear_forward_emulated(v, layer.fp8core_dq[e][part], None, recipe=recipe,
                                                   pow2_activation=pow2_act)
            return fp8_linear_forward(v, self.expert_weights(layer, e)[part], None, recipe=recipe,
                                      pow2_activation=pow2_act, backend=layer.fp8core_backend)

        return experts_forward(x, topk_ids, topk_weights, num_experts=layer.w13_weight.shape[0], linear=linear,
                               act=torch.nn.functional.silu)
