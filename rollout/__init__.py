"""The rollout engine: the vLLM actor (RolloutWorker), its KV-cache modes and the vLLM quantization plugins (fp8core FP8 linears, BF16 emulation)."""
