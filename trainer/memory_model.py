"""A trainer rank's peak memory, predicted: the terms of one optimizer update's peak above the rank's post-load
baseline, from the model's shape, the number of data-parallel ranks M, the tokens of one micro-batch and the recipe.

The peak of a steady-state step (its second and later) falls in the backward of an update's last micro-batch, when
everything below is alive at once:

==========================  ==================================================================================
term                        bytes per rank
==========================  ==================================================================================
optimizer                   8 P / M: AdamW's two FP32 moments, sharded by FSDP2 (created in the first step)
gradients                   4 P / M: FP32 gradients of this rank's shard (reduce-scattered per micro-batch).
                            With one micro-batch per update they are created as the backward frees the
                            activations, so the peak holds the larger of the two, not their sum
FP8 weight cache            one rank (M = 1) only: each FP8 linear's quantized weight for the step (1 B per
                            parameter of codes; + 4 B of its dequantization where the GEMM is emulated)
gathered layers             M > 1: one decoder layer's full FP32 weights and its full gradient before the
                            reduce-scatter (2 x 4 B x layer parameters), + 4 B x layer parameters per layer
                            gathered ahead (``prefetch``: 0 on a CPU, where gloo's all-gathers are synchronous
                            and tests/trainer/test_dp_policy.py counts one gathered layer at a time; FSDP2
                            prefetches 1 on a GPU); the root unit (embeddings, final norm, output projection)
                            stays gathered during the update, with its full gradient (2 x 4 B x root
                            parameters x (1 - 1/M)); the FP8 linear of the gathered layer quantizes its weight
                            per use (the largest linear's copy)
activations                 the micro-batch's tokens x what autograd saves per token: per decoder layer
                            6 h + 4 i + 4 q + 4 kv elements (h hidden, i MLP width, q / kv the query and key /
                            value widths: the residual stream and norms, the MLP's gate, up, activation and
                            product, queries and keys before and after their norm and rotation, the attention
                            kernel's copies, values, the attention output); a Mixture-of-Experts layer saves
                            k (3 h + 4 i_expert) + 2 E instead of 4 i, for its k of E experts; + 3 h for the
                            final norm (its input, the normalized and the scaled output). With activation
                            checkpointing: h per layer (its input) + one layer's full set while the backward
                            recomputes it
logits                      tokens x vocabulary x 3 x 4 B: logits, their log-softmax and its gradient (FP32)
backward transients         one decoder layer's activations again: the gradients of its saved tensors and the
                            FP8 backward's quantized operands while the backward passes the layer
process constant            measured: what a step allocates beyond the tensors above (the allocator's arenas,
                            autograd's graph, collectives' buffers, the batch), on a probe model too small for
                            the other terms to matter (bench.memory)
==========================  ==================================================================================

P counts every parameter (masters are FP32 on the trainer; the baseline holds them, so they are not a term);
activations are FP32 (4 B) except, under BF16 autocast (``policy.precision: bfloat16``; ``autocast=True``), what
autocast itself casts: per decoder layer the attention kernel's queries, keys, values and output (2 q + 2 kv
elements, 2 B) and the output projection's input (h of the final norm's 3 h, 2 B). The FP8 linears' inputs and
outputs stay FP32 under autocast (fp8core's linear runs outside it), as do the norms, the MLP and the experts; a model
that counted every activation at 2 B under autocast undercounted them by ~1.9x. The counts of
saved tensors per token come from the pipeline's own forward (Qwen3 decoder layers with fp8core linears, counted with
autograd's saved-tensor hooks, deduplicated by storage); a different attention kernel or model family moves them.
``bench.memory`` prints each measured peak beside this prediction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

F32 = 4


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory terms depend on (a Hugging Face ``config.json``'s fields, Qwen3 / Qwen3-MoE / Llama)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    experts: int = 0  # > 0: every decoder layer is a Mixture-of-Experts layer of this many experts
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @classmethod
    def from_config(cls, cfg: Mapping) -> ModelShape:
        """From a ``config.json`` dictionary; a missing size field is named in the error."""
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(vocab=int(cfg["vocab_size"]), hidden=h, intermediate=int(cfg.get("intermediate_size") or 0),
                       layers=int(cfg["num_hidden_layers"]), heads=heads,
                       kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or h // heads),
                       tied=bool(cfg.get("tie_word_embeddings", False)),
                       experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                       experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
                       expert_intermediate=int(cfg.get("moe_intermediate_size") or 0))
        except KeyError as e:
            raise ValueError(f"model config: no {e.args[0]!r} field") from None

    # parameters
    @property
    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv  # q, o; k, v

    @property
    def mlp_params(self) -> int:
        if self.experts:
            return self.experts * 3 * self.hidden * self.expert_intermediate
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        norms = 2 * self.hidden + 2 * self.head_dim  # input / post-attention norms, Qwen3's q / k norms
        router = self.hidden * self.experts
        return self.attention_params + self.mlp_params + norms + router

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def fp8_params(self) -> int:
        """Parameters of the decoder layers' linears (the FP8 ones; routers stay high precision)."""
        return self.layers * (self.attention_params + self.mlp_params)

    @property
    def largest_linear(self) -> int:
        q = self.heads * self.head_dim
        mlp = self.hidden * (self.expert_intermediate if self.experts else self.intermediate)
        return max(self.hidden * q, mlp)

    # activations
    def layer_activation_bytes(self, autocast: bool = False) -> int:
        """Bytes autograd saves per token in one decoder layer: FP32, but the attention kernel's 2 q + 2 kv elements
        in BF16 under BF16 autocast (module docstring)."""
        bf16 = 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim if autocast else 0
        return F32 * self.layer_activation_elems() - 2 * bf16

    def layer_activation_elems(self) -> int:
        """Elements autograd saves per token in one decoder layer (module docstring)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = 6 * self.hidden + 4 * q + 4 * kv
        if self.experts:
            return attn + self.experts_per_token * (3 * self.hidden + 4 * self.expert_intermediate) + 2 * self.experts
        return attn + 4 * self.intermediate


def predict_peak(shape: ModelShape, *, world: int, micro_batch_tokens: int, micro_batches: int = 2,
                 fp8: str | None = "emulated", activation_checkpointing: bool = False, autocast: bool = False,
                 prefetch: int = 0, process_constant: float = 0.0) -> dict[str, float]:
    """The terms (bytes) of one rank's steady-state peak above its baseline and their ``total``.

    ``fp8``: None (no FP8 linears), ``"emulated"`` (FP8 codes computed in FP32: the CPU's trainer) or ``"native"``
    (FP8 GEMMs: codes only). ``autocast``: the forward runs under BF16 autocast (module docstring).
    ``micro_batch_tokens``: rows x padded length of one training micro-batch; ``micro_batches``: how many one update
    runs on this rank."""
    if world < 1 or micro_batch_tokens < 0 or micro_batches < 1:
        raise ValueError(f"world >= 1, micro_batch_tokens >= 0 and micro_batches >= 1 required, got {world}, "
                         f"{micro_batch_tokens}, {micro_batches}")
    if fp8 not in (None, "emulated", "native"):
        raise ValueError(f"fp8: {fp8!r} is not one of None, 'emulated', 'native'")
    s, m, t = shape, world, micro_batch_tokens
    fp8_bytes = 0 if fp8 is None else (1 + F32 if fp8 == "emulated" else 1)
    terms = {"optimizer": 2 * F32 * s.params / m, "gradients": F32 * s.params / m}
    terms["fp8_weight_cache"] = s.fp8_params * fp8_bytes if m == 1 else 0.0
    terms["gathered_layers"] = 0.0 if m == 1 else (
        (2 + prefetch) * F32 * s.layer_params + 2 * F32 * s.root_params * (1 - 1 / m) + fp8_bytes * s.largest_linear)
    per_layer = s.layer_activation_bytes(autocast)
    if activation_checkpointing:  # each layer's input (the FP32 residual stream) + one layer recomputed
        saved = s.layers * s.hidden * F32 + per_layer
    else:
        saved = s.layers * per_layer
    final_norm = (2 * F32 + 2) * s.hidden if autocast else 3 * F32 * s.hidden  # the output projection's input BF16
    terms["activations"] = float(t * (saved + final_norm))
    if micro_batches == 1:  # gradients appear as activations are freed: the peak holds the larger
        terms["gradients"] = max(0.0, terms["gradients"] - terms["activations"])
    terms["logits"] = float(t * s.vocab * 3 * F32)
    terms["backward_transients"] = float(t * per_layer)
    terms["process_constant"] = float(process_constant)
    terms["total"] = math.fsum(terms.values())
    return terms


def scale_bytes(recipe: str, *, held: bool) -> float:
    """Dequantization-scale bytes per FP8 weight of a recipe's weights: blockwise one FP32 per 128x128 block; mxfp8
    one per 1x32 group, served (refit, export) as an E8M0 byte and ``held`` by the engine as FP32, what its GEMMs
    read (fp8core.serve.served_scale_dtype). The GPU recipes are blockwise or mxfp8."""
    if recipe == "blockwise":
        return F32 / (128 * 128)
    if recipe == "mxfp8":
        return (F32 if held else 1) / 32
    raise ValueError(f"the memory model knows the GPU recipes' weight scales (blockwise, mxfp8), not {recipe!r}")


def _layer_bytes(shape: ModelShape, fp8: bool, scale: float = F32 / (128 * 128)) -> float:
    """One decoder layer: its linears 1 B per parameter + ``scale`` bytes of scales per parameter when FP8 (2 B
    otherwise), norms 2 B, the router 4 B."""
    router = shape.hidden * shape.experts
    linear = shape.attention_params + shape.mlp_params
    if not fp8:
        return 2 * (shape.layer_params - router) + F32 * router
    return linear * (1 + scale) + 2 * (shape.layer_params - linear - router) + F32 * router


def served_bytes(shape: ModelShape, fp8_layers: int, recipe: str = "blockwise", *, held: bool = False) -> float:
    """The served state's bytes (fp8core.serve): what a refit ships (``held``: what an engine holds, the same but
    for mxfp8's scales) -- ``fp8_layers`` FP8 decoder layers, the rest BF16, embeddings, final norm and output
    projection BF16."""
    scale = scale_bytes(recipe, held=held)
    return (fp8_layers * _layer_bytes(shape, True, scale) + (shape.layers - fp8_layers) * _layer_bytes(shape, False)
            + 2 * shape.root_params)


def predict_engine(shape: ModelShape, *, fp8_layers: int, kv_bytes_per_token: int, gpu_bytes: float,
                   utilization: float, recipe: str = "blockwise") -> dict[str, float]:
    """A rollout engine's memory on one GPU (bytes): its weights as the FP8 engine holds them on the scaled_mm path
    (rollout.vllm_fp8.fp8_layer_memory measures ~1 byte per FP8 parameter on the tiny engines) -- the FP8 decoder
    layers' linears 1 B per parameter + their scales (:func:`scale_bytes`), the other parameters 2 B (BF16: embeddings,
    output projection, norms, the BF16-kept layers), routers 4 B (FP32) -- and what vLLM's budget
    (``utilization`` x the GPU) leaves for the KV cache, in tokens. vLLM's activation workspace and CUDA graphs come
    out of that budget too and are not counted (vLLM profiles them at start-up)."""
    fp8 = fp8_layers * (shape.attention_params + shape.mlp_params)
    weights = served_bytes(shape, fp8_layers, recipe, held=True)
    kv_room = utilization * gpu_bytes - weights
    return {"fp8_params": float(fp8), "weights": float(weights), "budget": utilization * gpu_bytes,
            "kv_room": kv_room, "kv_tokens": max(0.0, kv_room) / kv_bytes_per_token}


def predict_refit(shape: ModelShape, *, fp8_layers: int, engines: int, trainers: int,
                  recipe: str = "blockwise") -> dict[str, float]:
    """One refit's bytes and the memory it adds per process (bytes), for both transports (cluster.refit_transport),
    from the model's shape: what bench.refit measures on CPU at 2.9M-103M, extrapolated (seconds are not).

    Served state S: the engine's weights (:func:`served_bytes`). Buckets: each decoder layer (FP8 linears 1 B per
    parameter + block scales, or BF16), then the embeddings and the output projection one each (BF16). Collective:
    N x S cross between processes (each sender's share to each engine); a trainer rank adds ~2 of its 1/M shares of
    the largest bucket (its quantized tensors and its send buffer); an engine ~2 largest buckets (the M pieces and their joined
    tensors) plus the loader's FP32 staging of the largest FP8 layer (4 B per code). Object store: rank 0 gathers the
    FP32 state (4 B x P x (M - 1) / M cross) and holds it with S and S's serialized copy (4 P + 2 S); each of the N
    engines fetches S and holds it with the same staging."""
    served = served_bytes(shape, fp8_layers, recipe)
    largest = max(_layer_bytes(shape, True, scale_bytes(recipe, held=False)) if fp8_layers else 0.0,
                  _layer_bytes(shape, False) if fp8_layers < shape.layers else 0.0, 2 * shape.vocab * shape.hidden)
    staging = F32 * (shape.attention_params + shape.mlp_params) if fp8_layers else 0.0
    return {"served": served, "largest_bucket": largest,
            "moved_collective": engines * served,
            "moved_object_store": F32 * shape.params * (trainers - 1) / trainers + engines * served,
            "trainer_collective": 2 * largest / trainers, "engine_collective": 2 * largest + staging,
            "trainer_object_store": F32 * shape.params + 2 * served, "engine_object_store": served + staging}
