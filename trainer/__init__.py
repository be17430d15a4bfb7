"""The trainer: PolicyWorker (the one teacher-forced logprob path, the GRPO update, FP8 calibrations), data-parallel FSDP2 helpers, the FP8 KV-cache replay."""
