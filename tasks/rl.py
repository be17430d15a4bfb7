"""The RL-step tasks: refit -> rollout -> reward -> train -> calibrate, plus validation. Thin: each calls an actor
by name (weights and rollouts stay in Ray; only ObjectRefs, names and small metric dicts cross Prefect), logs its
metrics to MLflow and returns them with its wall time under ``time/*``."""

from __future__ import annotations

import time
from functools import lru_cache

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.context import RunContext
from tasks.tracking import log_metrics
from workers.cluster import actor
from workers.verifiers import verify

TASK = dict(cache_policy=NO_CACHE, log_prints=False)
VAL_TEMPERATURE = 0.01  # near-greedy: vLLM clamps smaller temperatures to 0.01 and the worker rejects 0


@lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def prompts_for(model_dir: str, rows: list[dict]) -> list[str]:
    from workers.tiny_model import chat_prompt

    tok = _tokenizer(model_dir)
    return [chat_prompt(tok, r["question"]) for r in rows]


@task(name="refit", **TASK, retries=1, retry_delay_seconds=2)
def refit(ctx: RunContext, kv_scales: dict | None = None) -> dict:
    """Policy weights (+ the KV scales the flow hands over, computed by ``calibrate``) -> rollout engine, actor to
    actor through the object store. The engine refuses scales staler than calibration.kv_scales_period allows."""
    t0 = time.perf_counter()
    policy, rollout = actor(ctx.policy), actor(ctx.rollout)
    version = ray.get(policy.info.remote())["step"]  # the policy step of the weights (KV scales are checked against it)
    weights = policy.refit_weights.remote()  # FP8 codes + scales for end-to-end FP8, else FP32 masters
    engine_s = ray.get(rollout.refit.remote(weights, kv_scales if ctx.kv_fp8 else None, weights_version=version))
    return {"time/refit_s": time.perf_counter() - t0, "time/refit_engine_s": engine_s}


@task(name="rollout", **TASK)
def rollout(ctx: RunContext, rows: list[dict], step: int) -> tuple[ray.ObjectRef, dict]:
    """Sample ``n`` responses per prompt; returns the Ray ref of the rollouts and throughput metrics."""
    t0 = time.perf_counter()
    g = ctx.gen
    ref = actor(ctx.rollout).generate.remote(prompts_for(ctx.model_dir, rows), n=g.n,
                                                max_tokens=g.max_tokens, temperature=g.temperature,
                                                top_p=g.top_p, seed=ctx.seed * 1_000_003 + step * 9973)
    ray.wait([ref], fetch_local=False)
    stats = ray.get(actor(ctx.rollout).stats.remote())
    wall = time.perf_counter() - t0
    return ref, {"time/rollout_s": wall, "throughput/rollout_tokens_per_s": stats["last_generated_tokens"] / wall,
                 "rollout/generated_tokens": float(stats["last_generated_tokens"])}


def _verify(row: dict, text: str) -> tuple[bool, bool]:
    """(format_valid, correct) with the verifier of the row's task (``data.task``; rows without one: arithmetic)."""
    return verify(row.get("task", "arithmetic"), text, row["answer"])


@task(name="reward", **TASK)
def reward(ref: ray.ObjectRef, rows: list[dict]) -> tuple[list[float], dict]:
    """Verifier reward (1.0 when the response's final answer is correct), prompt-major order, and the share of
    responses whose answer is in the task's expected form (``reward/format_valid``)."""
    t0 = time.perf_counter()
    outs = ray.get(ref)
    checks = [_verify(row, s["text"]) for out, row in zip(outs, rows, strict=True) for s in out["samples"]]
    rewards = [1.0 if correct else 0.0 for _, correct in checks]
    truncated = sum(s["finish_reason"] == "length" for out in outs for s in out["samples"])
    return rewards, {"time/reward_s": time.perf_counter() - t0, "rollout/truncated_frac": truncated / len(rewards),
                     "reward/format_valid": sum(f for f, _ in checks) / len(checks)}


@task(name="train", **TASK)
def train(ctx: RunContext, ref: ray.ObjectRef, rewards: list[float], step: int) -> dict:
    """One GRPO step on the policy actor (loss, IS correction, clipping; Calibrated Clipping on its K-th steps)."""
    t0 = time.perf_counter()
    m = ray.get(actor(ctx.policy).train_step.remote(ref, rewards, step=step))
    m["time/train_s"] = time.perf_counter() - t0
    log_metrics(ctx.tracking_uri, ctx.run_id, m, step)
    return m


@task(name="calibrate", **TASK, retries=1)
def calibrate(ctx: RunContext, ref: ray.ObjectRef, step: int) -> tuple[dict | None, dict]:
    """KV-cache scales on the updated policy (every ``kv_period`` steps with an FP8 KV cache). Returns
    ``(scales or None, metrics)``; the flow hands the scales to the next refit (they carry the policy step)."""
    t0 = time.perf_counter()
    if not (ctx.kv_fp8 and step % ctx.kv_period == 0):
        return None, {"time/calibrate_s": 0.0}
    s = ray.get(actor(ctx.policy).calibrate_kv_scales.remote(ref, max_samples=ctx.kv_samples))
    m = {"time/calibrate_s": time.perf_counter() - t0}
    for key in ("k_scale", "v_scale"):
        m[f"kv/{key}_mean"] = sum(s[key]) / len(s[key])
        m[f"kv/{key}_max"] = max(s[key])
        m[f"kv/{key}_min"] = min(s[key])
    return s, m


@task(name="validate", **TASK, retries=1)
def validate(ctx: RunContext, rows: list[dict], step: int, *, kv_scales: dict | None = None,
             num_samples_to_keep: int = 4) -> dict:
    """Near-greedy decoding (T=0.01, fixed seed) of the validation prompts on the current policy weights (refit first) -> accuracy."""
    t0 = time.perf_counter()
    refit.fn(ctx, kv_scales)
    prompts, bs = prompts_for(ctx.model_dir, rows), ctx.val_batch_size  # grpo.val_batch_size prompts per call
    outs = []
    for i in range(0, len(prompts), bs):
        outs += ray.get(actor(ctx.rollout).generate.remote(
            prompts[i:i + bs], n=1, max_tokens=ctx.gen.max_tokens, temperature=VAL_TEMPERATURE, seed=i))
    texts = [o["samples"][0]["text"] for o in outs]
    checks = [_verify(r, t) for t, r in zip(texts, rows, strict=True)]
    correct = [c for _, c in checks]
    lengths = [len(o["samples"][0]["token_ids"]) for o in outs]
    m = {"val/accuracy": sum(correct) / len(correct), "val/format_valid": sum(f for f, _ in checks) / len(checks),
         "val/response_length_mean": sum(lengths) / len(lengths),
         "val/num_samples": float(len(rows)), "time/validate_s": time.perf_counter() - t0}
    log_metrics(ctx.tracking_uri, ctx.run_id, m, step)
    samples = [{"question": r["question"], "answer": r["answer"], "response": t, "correct": bool(c)}
               for r, t, c in list(zip(rows, texts, correct, strict=True))[:num_samples_to_keep]]
    return {"metrics": m, "samples": samples}
