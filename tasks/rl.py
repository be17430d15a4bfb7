"""The RL-step tasks: refit -> rollout -> reward -> train -> calibrate, plus validation. Thin: each calls an actor
by name (weights and rollouts stay in Ray; only ObjectRefs, names and small metric dicts cross Prefect), logs its
metrics to MLflow and returns them with its wall time under ``time/*``."""

from __future__ import annotations

import time

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster.runtime import actor, await_actors, dead_actors, get, policy_call, policy_refs, split_groups, wait
from process.faults import arm_kill
from rewards.verifiers import verify
from tasks.context import RunContext
from tasks.tracking import log_metrics

TASK = dict(cache_policy=NO_CACHE, log_prints=False)
ENGINE_RESTART_TIMEOUT_S = 300.0  # a restarted engine rebuilds vLLM (seconds on CPU; model load + warm-up on GPU)
VAL_TEMPERATURE = 0.01  # near-greedy: vLLM clamps smaller temperatures to 0.01 and the worker rejects 0


def prompts_for(ctx: RunContext, rows: list[dict]) -> list[str]:
    """The prompt of each row (``ctx.prompt``: the recipe's system prompt / template, else the row's task's),
    rendered by the first rollout engine with its tokenizer (the driver loads none)."""
    return get(actor(ctx.rollouts[0]).render_prompts.remote(ctx.prompt, [(r["question"], r["task"]) for r in rows]))


def rollout_seed(run_seed: int, step: int) -> int:
    """The sampling seed of step ``step``'s rollouts in a run seeded ``run_seed`` (the engine derives each prompt's
    seeds from it): the one formula the flow and the benchmarks use, so a bench step samples what the run's step did."""
    return run_seed * 1_000_003 + step * 9973


def _fault_due(ctx: RunContext, what: str, step: int) -> bool:
    """TEST-ONLY: a ``testing.fault_kill_*_at_step`` kill (``kill_rollout`` / ``kill_policy``) is due now."""
    return ctx.hooks is not None and ctx.hooks.kill_due(what, step)


@task(name="refit", **TASK, retries=1, retry_delay_seconds=2)
def refit(ctx: RunContext, kv_scales: dict | None = None) -> dict:
    """Policy weights (+ the KV scales the flow hands over, computed by ``calibrate``) -> every rollout engine.
    Each engine records the policy step it loaded (``refit/weights_version``; rollouts check it) and refuses KV
    scales staler than calibration.kv_scales_period allows.

    ``cluster.refit_transport``: ``collective`` (default) -- every trainer rank sends from its own shard, one
    decoder layer at a time, over a refit group of the trainer ranks and the engines (process.refit_wire; formed
    again when a member restarted), into the engines' parameters; ``object_store`` -- the policy's
    ``refit_weights`` (the whole served state, gathered to rank 0) is one Ray object each engine fetches."""
    from trainer.policy import PolicyWorker

    t0 = time.perf_counter()
    policy = actor(ctx.policy)
    version = get(policy.info.remote())["step"]  # the policy step of the weights (KV scales are checked against it)
    scales = kv_scales if ctx.kv_fp8 else None
    m: dict = {}
    if ctx.refit_transport == "collective":
        sent, got, gen = _refit_over_wire(ctx, scales, version)
        engine_s = [g["seconds"] for g in got]
        m["refit/bytes_sent"] = float(sum(x["bytes"] for x in sent))  # payload + checksums, all trainer ranks
        m["refit/group_generation"] = float(gen)  # grows when the group formed again (a restarted member)
        # where a refit's time goes (the slowest member of each side): the senders making their buckets (quantizing
        # their shards), waiting on the wire, the engines' loader
        m["time/refit_make_s"] = max(x["make_s"] for x in sent)
        m["time/refit_wire_s"] = max(x["wire_s"] for x in sent)
        m["time/refit_load_s"] = max(g["load_s"] for g in got)
    else:
        # FP8 codes + scales for end-to-end FP8, else FP32 masters: data-parallel ranks gather them to rank 0 (all
        # take part; the others return nothing)
        weights, *others = policy_refs(ctx.trainers, PolicyWorker.refit_weights)
        engine_s = get([actor(name).refit.remote(weights, scales, weights_version=version) for name in ctx.rollouts])
        get(others)
    return {**m, "time/refit_s": time.perf_counter() - t0, "time/refit_engine_s": max(engine_s),
            "time/refit_engine_mean_s": sum(engine_s) / len(engine_s), "refit/weights_version": float(version)}


def _refit_over_wire(ctx: RunContext, scales: dict | None, version: int) -> tuple[list[dict], list[dict], int]:
    """One refit over the refit group (forming it first where a member is in none or in another one): the
    trainer ranks' and the engines' results, and the group's generation. A member that dies fails the others within
    the collective timeout; its own death (Ray's actor error, naming it) is what is raised, so that the flow restarts
    a dead engine."""
    from ray.exceptions import RayActorError

    from trainer.policy import PolicyWorker

    members = [*ctx.trainers, *ctx.rollouts]
    gens = get(policy_refs(ctx.trainers, PolicyWorker.refit_generation)
               + [actor(n).refit_generation.remote() for n in ctx.rollouts])
    if None in gens or len(set(gens)) > 1:
        gen = max((g for g in gens if g is not None), default=0) + 1
        world, timeout = len(members), ctx.collective_timeout_s
        address = get(actor(ctx.trainers[0]).refit_open_store.remote(world, timeout))
        kw = dict(world=world, senders=len(ctx.trainers), generation=gen, timeout_s=timeout)
        get([actor(n).refit_join.remote(address, rank=i, **kw) for i, n in enumerate(members)])
    else:
        gen = gens[0]
    refs = (policy_refs(ctx.trainers, PolicyWorker.refit_to_wire)
            + [actor(n).refit_from_wire.remote(scales, weights_version=version) for n in ctx.rollouts])
    wait(refs)
    out, errors = [], []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - every member's outcome is read before one is raised
            errors.append(e)
    if errors:
        raise next((e for e in errors if isinstance(e, RayActorError)), errors[0])
    return out[:len(ctx.trainers)], out[len(ctx.trainers):], gen


@task(name="rollout", **TASK)
def rollout(ctx: RunContext, rows: list[dict], step: int,
            weights_version: int | None = None) -> tuple[ray.ObjectRef, dict]:
    """Sample ``n`` responses per prompt on the rollout engines: the prompts (whole GRPO groups) are split into
    consecutive ranges, one per engine, generated concurrently and gathered in prompt order into one object in
    Ray's object store (on the first engine; with one engine its own result). Per-prompt seeds do not depend on the
    split. ``weights_version``: the policy step the refit loaded; an engine holding other weights refuses.
    Returns the Ray ref of the rollouts and throughput metrics, ``rollout/weights_version`` (the policy step of the
    weights the engines generated with, as they report it), and the wall-clock span of the task,
    ``time/rollout_start_unix`` / ``_end_unix`` (the step uses it to measure its overlap with training)."""
    t0, start_unix = time.perf_counter(), time.time()
    g = ctx.gen
    prompts = prompts_for(ctx, rows)
    seed = rollout_seed(ctx.seed, step)  # prompt i gets seed + i * n on whichever engine runs it
    ranges = split_groups(len(prompts), len(ctx.rollouts))
    engines = [actor(name) for name in ctx.rollouts[:len(ranges)]]
    if _fault_due(ctx, "kill_rollout", step):
        get(engines[0].__ray_call__.remote(arm_kill))  # TEST-ONLY: engine 0 dies mid-rollout (process/faults.py)
    n = ctx.group_size
    parts = [e.generate.remote(prompts[a:b], n=n, max_tokens=g.max_new_tokens, temperature=g.temperature,
                               top_p=g.top_p, seed=seed + a * n, weights_version=weights_version,
                               routing=True)  # MoE engines attach each token's experts (replay, moe/* metrics)
             for e, (a, b) in zip(engines, ranges, strict=True)]
    ref = parts[0] if len(parts) == 1 else engines[0].gather.remote(*parts)
    wait([ref])
    stats = get([e.stats.remote() for e in engines])
    wall = time.perf_counter() - t0
    tokens = sum(s["last_generated_tokens"] for s in stats)
    gen_s = [s["last_generate_s"] or 0.0 for s in stats]
    routing_s = [s.get("last_routing_s") for s in stats]
    extra = {"time/rollout_routing_s": max(routing_s)} if all(x is not None for x in routing_s) else {}
    held = [s["last_weights_version"] for s in stats]  # the policy step each engine generated this rollout with
    if all(v is not None for v in held):
        extra["rollout/weights_version"] = float(min(held))  # the stalest engine's (they all checked the same step)
    return ref, {**extra, "time/rollout_s": wall, "throughput/rollout_tokens_per_s": tokens / wall,
                 "rollout/generated_tokens": float(tokens), "rollout/engines": float(len(engines)),
                 "time/rollout_engine_max_s": max(gen_s), "time/rollout_engine_min_s": min(gen_s),
                 "time/rollout_start_unix": start_unix, "time/rollout_end_unix": time.time()}


def _verify(row: dict, text: str) -> tuple[bool, bool]:
    """(format_valid, correct) from the reward of the row's task (``data.task``, which every row carries: PromptSource
    and the evaluation sets attach it; the tasks and their rewards: rewards/registry.py)."""
    return verify(row["task"], text, row["answer"])


@task(name="reward", **TASK)
def reward(ref: ray.ObjectRef, rows: list[dict]) -> tuple[list[float], dict]:
    """Verifier reward (1.0 when the response's final answer is correct), prompt-major order, and the share of
    responses whose answer is in the task's expected form (``reward/format_valid``)."""
    t0 = time.perf_counter()
    outs = get(ref)
    checks = [_verify(row, s["text"]) for out, row in zip(outs, rows, strict=True) for s in out["samples"]]
    rewards = [1.0 if correct else 0.0 for _, correct in checks]
    truncated = sum(s["finish_reason"] == "length" for out in outs for s in out["samples"])
    return rewards, {"time/reward_s": time.perf_counter() - t0, "rollout/truncated_frac": truncated / len(rewards),
                     "reward/format_valid": sum(f for f, _ in checks) / len(checks)}


@task(name="train", **TASK)
def train(ctx: RunContext, ref: ray.ObjectRef, rewards: list[float], step: int) -> dict:
    """One GRPO step on the policy actor (loss, IS correction, clipping; Calibrated Clipping on its K-th steps)."""
    from trainer.policy import PolicyWorker

    t0 = time.perf_counter()
    if _fault_due(ctx, "kill_policy", step):
        get(actor(ctx.trainers[-1]).__ray_call__.remote(arm_kill))  # TEST-ONLY: the last rank dies mid-step
    m = policy_call(ctx.trainers, PolicyWorker.train_step, ref, rewards, step=step)
    m["time/train_s"] = time.perf_counter() - t0
    log_metrics(ctx.tracking_uri, ctx.run_id, m, step)
    return m


@task(name="recover_engines", **TASK)
def recover_engines(ctx: RunContext, err: BaseException) -> dict:
    """After an actor error in refit / rollout / reward: which engines died (``err`` names one; any that no longer
    resolves is gone too), and wait until Ray has restarted every engine (``cluster.rollout_max_restarts``). Returns
    ``{"engines": [names], "wait_s": seconds}``; raises the original error when no rollout engine is among the dead
    (a trainer: the flow stops the run) or an engine does not come back."""
    dead = dead_actors(err, ctx.rollouts)
    if not dead or dead_actors(err, ctx.trainers):
        raise err
    return {"engines": dead, "wait_s": await_actors(ctx.rollouts, ENGINE_RESTART_TIMEOUT_S)}


@task(name="calibrate", **TASK, retries=1)
def calibrate(ctx: RunContext, ref: ray.ObjectRef, step: int) -> tuple[dict | None, dict]:
    """KV-cache scales on the updated policy (every ``kv_period`` steps with an FP8 KV cache). Returns
    ``(scales or None, metrics)``; the flow hands the scales to the next refit (they carry the policy step)."""
    t0 = time.perf_counter()
    if not (ctx.kv_fp8 and step % ctx.kv_period == 0):
        return None, {"time/calibrate_s": 0.0}
    from trainer.policy import PolicyWorker

    s = policy_call(ctx.trainers, PolicyWorker.calibrate_kv_scales, ref, max_samples=ctx.kv_samples)
    m = {"time/calibrate_s": time.perf_counter() - t0}
    for key in ("k_scale", "v_scale"):
        m[f"kv/{key}_mean"] = sum(s[key]) / len(s[key])
        m[f"kv/{key}_max"] = max(s[key])
        m[f"kv/{key}_min"] = min(s[key])
    return s, m


SAMPLED_SEED = 7_000_001  # sampled evaluation: prompt g of a set gets seeds SAMPLED_SEED + g*n ... (same every step)


def _generate_rows(ctx: RunContext, rows: list[dict], *, n: int, temperature: float, top_p: float,
                   seed0: int, desc: str = "") -> list[dict]:
    """``n`` completions per row, grpo.val_batch_size prompts per engine call; prompt g gets seed ``seed0 + g*n``
    (independent of the chunking, the same at every validation step: common random numbers across steps)."""
    prompts, bs = prompts_for(ctx, rows), ctx.val_batch_size
    # fan-out: consecutive prompt ranges per engine (cluster.runtime.split_groups), each in calls of bs prompts; all
    # calls issued at once (each engine runs its own in order), gathered in prompt order
    calls = [(k, i, min(i + bs, b)) for k, (a, b) in enumerate(split_groups(len(prompts), len(ctx.rollouts)))
             for i in range(a, b, bs)]
    refs = [actor(ctx.rollouts[k]).generate.remote(
                prompts[i:j], n=n, max_tokens=ctx.gen.max_new_tokens, temperature=temperature, top_p=top_p,
                seed=seed0 + i * n) for k, i, j in calls]
    from process.progress import progress

    out = []
    with progress(total=len(prompts), desc=desc or "validation", unit="prompt") as bar:  # a bar on a terminal only
        for (_, i, j), ref in zip(calls, refs, strict=True):  # in prompt order (each engine runs its calls in order)
            out += get(ref)
            bar.update(j - i)
    return out


def _set_metrics(prefix: str, records: list[dict], ev, *, sampled: bool) -> dict:
    """Greedy accuracy (Wilson 95% CI), format-valid, length; with sampled results pass@k / avg@k (unbiased, bootstrap
    95% CI over prompts) -- metric names ``{prefix}accuracy``, ``{prefix}accuracy_lo`` / ``_hi``, ``{prefix}pass_at_k``."""
    import numpy as np

    from fp8core.stats import accuracy_estimate, sample_estimates

    acc = accuracy_estimate([r["correct"] for r in records])
    m = {f"{prefix}accuracy": acc.value, f"{prefix}accuracy_lo": acc.lo, f"{prefix}accuracy_hi": acc.hi,
         f"{prefix}format_valid": sum(r["format_valid"] for r in records) / len(records),
         f"{prefix}response_length_mean": sum(r["response_tokens"] for r in records) / len(records),
         f"{prefix}num_prompts": float(len(records))}
    with_samples = [r for r in records if "samples_correct" in r]
    if sampled and with_samples:
        mat = np.array([r["samples_correct"] for r in with_samples], dtype=bool)
        for name, e in sample_estimates(mat, ev.ks, n_boot=ev.n_boot).items():
            key = prefix + name.replace("@", "_at_")
            m.update({key: e.value, f"{key}_lo": e.lo, f"{key}_hi": e.hi})
        m[f"{prefix}sampled_format_valid"] = float(np.mean([r["samples_format_valid"] for r in with_samples]))
        m[f"{prefix}sampled_prompts"] = float(len(with_samples))
    return m


@task(name="validate", **TASK, retries=1)
def validate(ctx: RunContext, sets: dict[str, list[dict]], step: int, *, kv_scales: dict | None = None,
             sampled: bool = False, num_samples_to_keep: int = 4) -> dict:
    """Validation of the current policy weights (refit first) on each named set: near-greedy decoding (T=0.01,
    fixed seeds) -> accuracy with a Wilson 95% CI; with ``sampled`` also ``ctx.eval.n`` samples per prompt at the
    rollout temperature on the first ``ctx.eval.max_prompts`` prompts of the sets in ``ctx.eval.sets`` -> unbiased
    pass@k / avg@k with bootstrap CIs.

    Metrics ``val/<set>/...`` per set; the ``main`` set is also logged under the original names (``val/accuracy``,
    ``val/format_valid``, ...). Returns ``{"metrics", "samples" (first main-set responses), "records": {set:
    per-prompt dicts (id, question, answer, response, format_valid, correct[, samples_correct,
    samples_format_valid])}}`` -- the flow writes the records to run_dir/val/<set>/step_XXXXXX.jsonl."""
    t0 = time.perf_counter()
    await_actors(ctx.rollouts, ENGINE_RESTART_TIMEOUT_S)  # a retry after an engine died: wait for its restart
    refit.fn(ctx, kv_scales)
    ev = ctx.eval
    sampled = sampled and ev.n > 0
    metrics, records, t_sampled = {}, {}, 0.0
    for name, rows in sets.items():
        outs = _generate_rows(ctx, rows, n=1, temperature=VAL_TEMPERATURE, top_p=1.0, seed0=0,
                              desc=f"validation {name} (step {step})")
        texts = [o["samples"][0]["text"] for o in outs]
        checks = [_verify(r, t) for t, r in zip(texts, rows, strict=True)]
        recs = [{"id": r.get("id", i), "question": r["question"], "answer": r["answer"], "response": t,
                 "format_valid": bool(f), "correct": bool(c), "response_tokens": len(o["samples"][0]["token_ids"])}
                for i, (r, t, (f, c), o) in enumerate(zip(rows, texts, checks, outs, strict=True))]
        recs = ctx.validation_records(recs, ctx.seed * 7919 + step)
        if sampled and name in ev.sets:
            ts = time.perf_counter()
            sub = rows[:ev.max_prompts]
            souts = _generate_rows(ctx, sub, n=ev.n, temperature=ctx.gen.temperature, top_p=ctx.gen.top_p,
                                   seed0=SAMPLED_SEED, desc=f"sampled evaluation {name} (step {step})")
            for rec, row, o in zip(recs, sub, souts, strict=False):
                sc = [_verify(row, s["text"]) for s in o["samples"]]
                rec["samples_correct"] = [bool(c) for _, c in sc]
                rec["samples_format_valid"] = [bool(f) for f, _ in sc]
            t_sampled += time.perf_counter() - ts
        records[name] = recs
        metrics.update(_set_metrics(f"val/{name}/", recs, ev, sampled=sampled))
    if "main" in records:  # the original names, so existing consumers (plots, the regression, README) keep working
        for key in ("accuracy", "accuracy_lo", "accuracy_hi", "format_valid", "response_length_mean"):
            metrics[f"val/{key}"] = metrics[f"val/main/{key}"]
        metrics["val/num_samples"] = metrics["val/main/num_prompts"]
    metrics["time/validate_s"] = time.perf_counter() - t0
    metrics["time/validate_sampled_s"] = t_sampled
    log_metrics(ctx.tracking_uri, ctx.run_id, metrics, step)
    first = records.get("main") or next(iter(records.values()), [])
    samples = [{k: r[k] for k in ("question", "answer", "response", "correct")} for r in first[:num_samples_to_keep]]
    return {"metrics": metrics, "samples": samples, "records": records}
