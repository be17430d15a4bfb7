"""``python -m fp8core``: this CPU, the cap and the FP8 GEMM path built for it (the line every run logs first)."""
from fp8core.gemm import describe

print(describe())
