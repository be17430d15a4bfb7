"""The trainer's FP8 calibration passes: Calibrated Clipping of the PPO bounds after a step's update (item 5 of
trainer/train_step.py's docstring) and the per-layer KV-cache scales sent to the rollout engine with the next refit.

Functions of the PolicyWorker's state: ``worker`` is the PolicyWorker (trainer/policy.py) they read and update.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from trainer.batch import Batch
from trainer.dp import equal_count, gather_objects, per_layer_no_grad
from trainer.forward import autocast
from trainer.logprobs import shadow_logprobs
from trainer.train_step import StepState


def calibrate_clip(worker, st: StepState, m: dict[str, float]) -> None:
    """Calibrated Clipping (item 5): FP8 and BF16-shadow logprobs of the updated policy on the same tokens move
    the clip bounds later steps use; adds its diagnostics to ``m``."""
    b = st.b
    tc = time.perf_counter()
    new_fp8 = worker.logprobs(b)[0]
    new_bf16 = shadow_logprobs(worker, b)
    # the BF16 reference ratio is the shadow's own new / old: with old_logprobs=rollout it stands for a BF16
    # pipeline's pi_theta / pi_rollout, whose mismatch (~1.002) it leaves out
    (lo, hi), diag = worker.cc.calibrate(st.step, torch.exp((new_fp8 - st.ref_logp) * b.mask),
                                         torch.exp((new_bf16 - st.old_bf16) * b.mask), st.adv, b.mask,
                                         prob_fp8=torch.exp(new_fp8), prob_bf16=torch.exp(new_bf16))
    m.update(diag)
    st.t_cal += time.perf_counter() - tc


@torch.no_grad()
def calibrate_kv(worker, rollouts: Sequence[Mapping], *, max_samples: int) -> dict[str, list[float]]:
    """Per-layer K/V scales (amax / 448) from the policy's own forward over (prompt + response) sequences of the
    current batch; sent to the rollout engine with the next refit (``fp8core.rl.kv_calibration``)."""
    from fp8core.rl.kv_calibration import calibrate_kv_scales

    flat = []
    for r in rollouts:
        for s in r["samples"]:
            flat.append({"prompt_token_ids": r["prompt_token_ids"], "samples": [s]})
    b = Batch.from_rollouts(flat[:max_samples], pad_id=worker.tokenizer.pad_token_id)
    was = worker.model.training
    worker.model.eval()
    bs = worker.cfg.policy.logprob_batch_size
    batches = [{"input_ids": b.tokens[i:i + bs].to(worker.device),
                "attention_mask": b.attn[i:i + bs].to(worker.device)} for i in range(0, len(b), bs)]
    if worker.dp.active:  # each rank its share of the micro-batches; the percentile over all ranks' amaxes
        from fp8core.rl.kv_calibration import collect_qkv_amax, scales_from_amax, validate_kv_scales

        with per_layer_no_grad(worker.model, worker.dp), autocast(worker.cfg.policy.precision, worker.device,
                                                                  worker.bf16_emulation), torch.no_grad():
            mine = batches[worker.dp.rank::worker.dp.world]
            amax = collect_qkv_amax(worker.model, mine) if mine else None
            for _ in range(equal_count(len(batches), worker.dp) - len(mine)):  # rank 0's count (trainer/dp.py)
                worker.model(**batches[0])
        parts = [a for a in gather_objects(amax, worker.dp) if a is not None]
        amax = {k: torch.cat([a[k] for a in parts]) for k in parts[0]}
        scales = scales_from_amax(amax)
        validate_kv_scales(scales, num_layers=amax["q"].shape[1])
    else:
        with autocast(worker.cfg.policy.precision, worker.device, worker.bf16_emulation):
            scales = calibrate_kv_scales(worker.model, batches)
    worker.model.train(was)
    # version: the policy step whose weights produced these scales (the engine refuses stale ones at refit)
    worker.kv_scales = {**{k: [float(x) for x in v] for k, v in scales.items()}, "version": worker.step}
    return worker.kv_scales
