"""The ``fp8core`` vLLM method in every trainer recipe (blockwise, rowwise, tensorwise; pow2 on/off): a fused layer
(qkv_proj-like, partitions and K not multiples of 128) holds exactly the trainer's ``FP8Linear.quantized_weight()``
per partition and, for the same input tensor, returns exactly the trainer's separate FP8Linear outputs."""
import pytest
import torch

from fp8core.linear import RECIPES, FP8Linear, FP8LinearConfig

pytestmark = pytest.mark.slow  # imports vLLM (~10 s)


def _pow2(recipe: str, pow2: bool) -> bool:
    return pow2 or recipe == "mxfp8"  # mxfp8's scales are powers of two (E8M0) whatever a case asks


def _layer(recipe, widths, k, *, pow2_w, pow2_a, backend="auto"):
    from rollout.vllm_fp8 import Fp8CoreConfig, Fp8CoreLinearMethod, quantization_config_dict

    pow2_w, pow2_a = _pow2(recipe, pow2_w), _pow2(recipe, pow2_a)
    cfg = Fp8CoreConfig.from_config(quantization_config_dict(
        num_hidden_layers=2, fp8_recipe=recipe, pow2_weight_scaling_factors=pow2_w,
        pow2_activation_scaling_factors=pow2_a, backend=backend))
    method = Fp8CoreLinearMethod(cfg, "model.layers.1.self_attn.qkv_proj")
    layer = torch.nn.Module()
    method.create_weights(layer, k, list(widths), k, sum(widths), torch.bfloat16, weight_loader=None)
    return method, layer


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("widths,k,pow2", [((256, 128, 128), 256, False), ((200, 72, 72), 300, True)])
def test_engine_layer_equals_trainer_fp8linear(recipe, widths, k, pow2, single_rank):
    gen = torch.Generator().manual_seed(0)
    # FP32 masters off the BF16 grid (what refit ships), one partition with an outlier row
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n in widths]
    weights[1][3] *= 40
    method, layer = _layer(recipe, widths, k, pow2_w=pow2, pow2_a=pow2)
    layer.weight.data.copy_(torch.cat(weights))
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_block_size == ([128, 128] if recipe == "blockwise" else None)
    cfg = FP8LinearConfig(recipe=recipe, pow2_weight=_pow2(recipe, pow2), pow2_activation=_pow2(recipe, pow2))
    trainers = []
    for w, held in zip(weights, method.partitions(layer), strict=True):
        lin = FP8Linear(k, w.shape[0], bias=False, config=cfg)
        lin.weight.data.copy_(w)
        q = lin.quantized_weight()
        assert held.granularity == q.granularity
        assert torch.equal(held.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(held.scale, q.scale)
        trainers.append(lin)  # FP32 master, as in the trainer
    x = (torch.randn(5, k, generator=gen) * 3).to(torch.bfloat16)
    y = method.apply(layer, x)
    with torch.no_grad():
        expected = torch.cat([lin(x) for lin in trainers], dim=-1)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_engine_rows_in_any_batch_equal_the_trainers_batch(recipe, single_rank):
    """A fused engine layer fed the rows of one batch in decode-like pieces (1, 2, 7 and 54 rows) returns, in FP32,
    the trainer's FP8Linear outputs on the whole batch bit for bit: the CPU GEMM's order does not depend on M. The
    control: the dequantize -> FP32 GEMM emulation's outputs change with the batch (torch's GEMM picks its order by
    shape), so the same comparison fails there."""
    gen = torch.Generator().manual_seed(1)
    widths, k = (256, 128, 128), 384
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n in widths]
    x = torch.randn(64, k, generator=gen) * 2
    pieces = [(0, 1), (1, 3), (3, 10), (10, 64)]
    for backend in ("cpu", "emulated"):
        method, layer = _layer(recipe, widths, k, pow2_w=False, pow2_a=False, backend=backend)
        layer.weight.data.copy_(torch.cat(weights))
        method.process_weights_after_loading(layer)
        assert layer.fp8core_backend == backend and (layer.fp8core_weight_dq is None) == (backend == "cpu")
        assert (layer.fp8core_packed is None) == (backend != "cpu")
        engine = torch.cat([method.apply(layer, x[i:j]) for i, j in pieces])
        cfg = FP8LinearConfig(recipe=recipe, backend=backend)
        trainers = [FP8Linear(k, w.shape[0], bias=False, config=cfg) for w in weights]
        with torch.no_grad():
            for lin, w in zip(trainers, weights, strict=True):
                lin.weight.copy_(w)
            expected = torch.cat([lin(x) for lin in trainers], dim=-1)
        assert engine.dtype == torch.float32
        assert torch.equal(engine, expected) == (backend == "cpu"), backend


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_fp8_layer_holds_codes_packed_codes_and_scales_only(recipe, single_rank):
    """After load on the CPU op: 1 byte of codes + the packed codes (2 bytes per weight with BF16 units, 4 without)
    + scales per weight; no FP32 weight of the layer's size (the emulation's dequantized copy is gone)."""
    from fp8core.cpu import cpu_caps
    from fp8core.gemm import PackedWeight

    widths, k = (256, 128, 128), 384
    method, layer = _layer(recipe, widths, k, pow2_w=False, pow2_a=False, backend="cpu")
    layer.weight.data.copy_(torch.randn(sum(widths), k) * 0.05)
    method.process_weights_after_loading(layer)
    held = [*layer.parameters(), *layer.buffers()]
    for value in vars(layer).values():
        held += [value] if isinstance(value, torch.Tensor) else [value.values, value.scales] if isinstance(
            value, PackedWeight) else []
    unique = {t.data_ptr(): t for t in held if t.numel()}.values()
    nbytes = sum(t.numel() * t.element_size() for t in unique)
    weights = sum(widths) * k
    packed = 2 if cpu_caps().native_bf16 else 4
    # scales: ~1/32 B per weight at most, except mxfp8's 1x32 groups: an FP32 scale per 32 weights, held twice (the
    # layer's weight_scale_inv and the packed weight's per-block scales), 0.25 B per weight
    scales = 0.1 + (0.25 if recipe == "mxfp8" else 0)
    assert nbytes <= (1 + packed + scales) * weights, nbytes / weights
    packed_ptr = layer.fp8core_packed.values.data_ptr()  # FP32 values on CPUs without BF16 units: the packing
    assert not any(t.dtype == torch.float32 and t.numel() >= weights and t.data_ptr() != packed_ptr for t in unique)


def test_config_rejects_unknown_recipe_and_mismatched_block_size():
    from rollout.vllm_fp8 import Fp8CoreConfig, quantization_config_dict

    with pytest.raises(ValueError, match="fp8_recipe='blocky'"):
        quantization_config_dict(num_hidden_layers=2, fp8_recipe="blocky")
    with pytest.raises(ValueError, match="weight_block_size must be None for fp8_recipe='rowwise'"):
        Fp8CoreConfig.from_config({"num_hidden_layers": 2, "fp8_recipe": "rowwise", "weight_block_size": [128, 128]})


@pytest.mark.parametrize("recipe", RECIPES)
def test_prequantized_codes_and_scales_are_kept_bit_for_bit(recipe, single_rank):
    """FP8 over the wire / an FP8 export: the trainer's FP8 codes + scales, loaded per partition through the scale
    loader (shard ids as vLLM's stacked-parameter mapping passes them), are held as they are -- no re-quantization."""
    gen = torch.Generator().manual_seed(3)
    widths, k, shards = (256, 128, 128), 256, ("q", "k", "v")
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n in widths]
    method, layer = _layer(recipe, widths, k, pow2_w=True, pow2_a=False)
    cfg = FP8LinearConfig(recipe=recipe, pow2_weight=True, pow2_activation=_pow2(recipe, False))
    trainer_q = []
    for w in weights:
        lin = FP8Linear(k, w.shape[0], bias=False, config=cfg)
        lin.weight.data.copy_(w)
        trainer_q.append(lin.quantized_weight())
    layer.weight.data.copy_(torch.cat([q.data.to(torch.float32) for q in trainer_q]))  # FP8 codes, staged in FP32
    for shard, q in zip(shards, trainer_q, strict=True):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, q.scale, shard)
    method.process_weights_after_loading(layer)
    for held, q in zip(method.partitions(layer), trainer_q, strict=True):
        assert torch.equal(held.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(held.scale, q.scale)


def test_prequantized_load_refuses_partial_scales_and_non_fp8_values(single_rank):
    method, layer = _layer("blockwise", (128, 128), 128, pow2_w=False, pow2_a=False)
    layer.weight.data.normal_()  # not FP8 codes
    one = torch.ones(1, 1)
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, one, 0)
    with pytest.raises(ValueError, match="scales for partitions \\[0\\] of 2"):
        method.process_weights_after_loading(layer)
    method, layer = _layer("blockwise", (128, 128), 128, pow2_w=False, pow2_a=False)
    layer.weight.data.normal_()
    for shard in (0, 1):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, one, shard)
    with pytest.raises(ValueError, match="not FP8"):
        method.process_weights_after_loading(layer)
    with pytest.raises(ValueError, match="shape \\(2, 1\\)"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(2, 1), 0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_engine_layer_quantizes_its_input_once_and_equals_the_trainer(recipe, single_rank, monkeypatch):
    """The GPU path (``scaled_mm``, forced on CPU tensors): a fused layer quantizes its input once for all its
    partitions, runs one GEMM per partition (the trainer's shapes, so the same kernels) and returns the trainer's
    separate FP8Linear outputs bit for bit; on the meta device its whole forward runs, so it reads nothing back to
    the host (which a CUDA graph would not allow)."""
    import fp8core.linear as fl
    from fp8core.linear import ACT_GRANULARITY

    gen = torch.Generator().manual_seed(4)
    widths, k = (256, 128, 128), 256
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n in widths]
    x = torch.randn(2, 3, k, generator=gen)
    method, layer = _layer(recipe, widths, k, pow2_w=False, pow2_a=False, backend="scaled_mm")
    layer.weight.data.copy_(torch.cat(weights))
    method.process_weights_after_loading(layer)
    assert layer.fp8core_backend == "scaled_mm" and layer.fp8core_packed is None and layer.fp8core_weight_dq is None
    seen = []
    real = fl.quantize  # where the layer's forward quantizes (fp8core.linear.fp8_linear_forward_partitions)
    monkeypatch.setattr(fl, "quantize", lambda v, gran, **kw: seen.append(gran) or real(v, gran, **kw))
    engine = method.apply(layer, x)
    assert seen == [ACT_GRANULARITY[recipe]]
    cfg = FP8LinearConfig(recipe=recipe, backend="scaled_mm", pow2_weight=_pow2(recipe, False),
                          pow2_activation=_pow2(recipe, False))
    trainers = [FP8Linear(k, w.shape[0], bias=False, config=cfg) for w in weights]
    with torch.no_grad():
        for lin, w in zip(trainers, weights, strict=True):
            lin.weight.copy_(w)
        expected = torch.cat([lin(x) for lin in trainers], dim=-1)
    assert engine.shape == (2, 3, sum(widths)) and torch.equal(engine, expected)

    meta_method, meta_layer = _layer(recipe, widths, k, pow2_w=False, pow2_a=False, backend="scaled_mm")
    meta_layer.weight = torch.nn.Parameter(torch.empty(sum(widths), k, device="meta"), requires_grad=False)
    meta_layer.weight_scale_inv = torch.nn.Parameter(meta_layer.weight_scale_inv.to("meta"), requires_grad=False)
    meta_method.process_weights_after_loading(meta_layer)
    out = meta_method.forward(meta_layer, torch.empty(2, 3, k, device="meta", dtype=torch.bfloat16), None)
    assert out.device.type == "meta" and out.shape == (2, 3, sum(widths)) and out.dtype == torch.bfloat16
