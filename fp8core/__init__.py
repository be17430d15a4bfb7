"""fp8core: pure torch + numpy FP8 numerics (quantization, FP8 linear training layers, model conversion, RL math).

Never imports prefect, ray, vllm, mlflow, s3fs or transformer_engine (tests/fp8core/test_layering.py enforces it).
See fp8core/quant.py for formats and the scale convention, fp8core/linear.py for the three GEMMs.
"""
from fp8core.quant import (
    E4M3_MAX,
    E5M2_MAX,
    FORMATS,
    GRANULARITIES,
    QuantizedTensor,
    dequantize,
    quantize,
)

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FORMATS",
    "GRANULARITIES",
    "QuantizedTensor",
    "dequantize",
    "quantize",
]
