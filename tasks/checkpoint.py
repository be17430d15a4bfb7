"""Checkpoint tasks: the policy actor writes/reads through fsspec itself (weights never cross Prefect); retried on
transient storage errors (a failed attempt leaves no manifest, so it is never resumed from)."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster.runtime import policy_call
from tasks.context import RunContext
from tasks.tracking import log_metrics, log_text


@task(name="save-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def save_checkpoint(ctx: RunContext, step: int) -> str:
    from trainer.policy import PolicyWorker

    t0 = time.perf_counter()
    ck = ctx.checkpoint
    uri = policy_call(ctx.trainers, PolicyWorker.save_checkpoint,  # data-parallel: gathered to rank 0, which writes
        ck.uri, step, extra={"mlflow_run_id": ctx.run_id, "tracking_uri": ctx.tracking_uri, "recipe": ctx.recipe,
                             "rollout_fp8_spec": ctx.rollout_fp8_spec},  # what tools.fp8_export serves
        keep_last_k=ck.keep_last_k, endpoint_url=ck.endpoint_url)
    log_metrics(ctx.tracking_uri, ctx.run_id, {"time/checkpoint_s": time.perf_counter() - t0}, step)
    log_text(ctx.tracking_uri, ctx.run_id, uri + "\n", f"checkpoints/step_{step:06d}.txt")
    return uri


@task(name="load-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def load_checkpoint(ctx: RunContext, step: int) -> dict:
    """Restore the policy actor; returns the small state the flow needs (incl. the KV scales to hand to refit)."""
    from trainer.policy import PolicyWorker

    ck = ctx.checkpoint
    state = policy_call(ctx.trainers, PolicyWorker.load_checkpoint, ck.uri, step, endpoint_url=ck.endpoint_url)
    return {k: state[k] for k in ("step", "uri", "mlflow_run_id", "clip_bounds", "kv_scales") if k in state}
