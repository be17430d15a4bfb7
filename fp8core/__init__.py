"""fp8core: pure torch + numpy FP8 numerics (quantization, FP8 linear training layers, model conversion, RL math).

Never imports prefect, ray, vllm, mlflow, s3fs or transformer_engine (tests/fp8core/test_layering.py enforces it).
Formats and the scale convention: fp8core/quant.py. The three FP8 GEMMs and the recipes: fp8core/linear.py.
Which modules go FP8 and the high-precision shadow switch: fp8core/convert.py.
"""
from fp8core.convert import convert_to_fp8, decoder_layers, fp8_layer_indices, fp8_modules, high_precision
from fp8core.linear import (
    FP8Linear,
    FP8LinearConfig,
    fp8_linear,
    fp8_linear_forward,
    fp8_mm,
    resolve_backend,
    weight_granularity,
)
from fp8core.quant import (
    E4M3_MAX,
    E5M2_MAX,
    FORMATS,
    GRANULARITIES,
    QuantizedTensor,
    dequantize,
    quantize,
)
from fp8core.spec import FP8Spec

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FORMATS",
    "FP8Linear",
    "FP8LinearConfig",
    "FP8Spec",
    "GRANULARITIES",
    "QuantizedTensor",
    "convert_to_fp8",
    "decoder_layers",
    "dequantize",
    "fp8_layer_indices",
    "fp8_linear",
    "fp8_linear_forward",
    "fp8_mm",
    "fp8_modules",
    "high_precision",
    "quantize",
    "resolve_backend",
    "weight_granularity",
]
