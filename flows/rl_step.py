"""Subflow ``rl_step``: refit (weights + KV scales) -> rollout -> reward -> train -> calibrate, each a Prefect task.

Synchronous (the default): the step's rollout runs after its refit, with the weights the step trains (trajectory age
0). Asynchronous (``grpo.async_grpo.enabled``): the rollouts of the next ``max_trajectory_age_steps`` steps are
generated while this step trains (Prefect tasks ``rollout-step-<t>`` in threads, overlapping ``train`` in the Prefect
UI's timeline; Ray runs the engines and the trainers concurrently), with the weights of this step's refit. The step
then trains on the rollout generated ahead of it, ``age = step - 1 - weights version`` versions old; the loss's
importance weight pi_old / pi_rollout (pi_old: the trainer's policy before this step's update) corrects staleness and
FP8 mismatch together (docs/async.md). The first step, a resumed run's first step and a step whose rollout was lost
generate their rollout now (age 0). Every refit loads one version's weights with the KV scales calibrated for them,
and only when the engines are idle: each step waits for its rollouts ahead before it returns.

A rollout engine that dies in refit, rollout or reward (Ray restarts it, ``cluster.rollout_max_restarts``) makes
the step wait for it and redo the three (same seeds: the same samples; nothing was trained or logged yet):
``fault/rollout_retries``, ``time/engine_restart_wait_s``. An engine that dies while generating ahead loses that
rollout only: the step it was for generates it again. A dead trainer fails the step (flows/grpo.py stops the run).

Returns the step's metrics, the KV scales for the next refit (this step's calibration, else the ones it was given)
and the rollouts generated ahead ({step: Ahead}). The metrics: everything the tasks reported plus ``time/step_s``,
each task's share of the step (``time/share_<task>``), the calibration share (KV scales + Calibrated Clipping), the
orchestration overhead (``time/orchestration_s``, ``time/share_orchestration``: step time not spent in the workers'
own work), the refit + KV-calibration share (``time/share_refit_kv``), ``throughput/samples_per_s``, the trajectories'
age (``async/trajectory_age_mean`` / ``_max``) and, asynchronous, the rollouts generated ahead during the step
(``async/rollout_ahead_s``), the share of the train task with one in flight (``async/train_overlap_frac``, at most
rollout / train time) and the share of their time that ran while the step trained (``async/rollout_hidden_frac``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prefect import flow
from ray.exceptions import RayError

from cluster.runtime import actor_error
from tasks import rl
from tasks.context import RunContext
from tasks.tracking import log_metrics

PHASES = ("refit", "rollout", "reward", "train", "calibrate")


@dataclass(frozen=True)
class Ahead:
    """A rollout generated ahead of its step: the Ray ref of its samples, the rollout task's metrics and the policy
    step of the weights that generated it."""

    step: int
    ref: Any
    metrics: dict
    version: int


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    """Seconds of interval ``a`` covered by the (disjoint) ``spans``."""
    return sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for b in spans)


def _generate(ctx: RunContext, rows: list[dict], step: int, kv_scales: dict | None,
              ahead: Ahead | None) -> tuple[Any, list[float], dict, int]:
    """Refit, then the step's rollout (``ahead``'s when it was generated ahead, else now) and its reward, redone when
    a rollout engine died in them. Returns (rollout ref, rewards, metrics, policy step of the rollout's weights)."""
    m: dict[str, float] = {}
    retries, waited = 0, 0.0
    while True:
        try:
            m.update(rl.refit(ctx, kv_scales))
            version = int(m["refit/weights_version"])
            if ahead is not None:
                try:
                    rewards, wm = rl.reward(ahead.ref, rows)
                    m.update(ahead.metrics)
                    m.update(wm)
                    ref, version = ahead.ref, ahead.version
                    break
                except RayError as e:  # its samples were lost with their engine's node: generate them now
                    print(f"step {step}: the rollout generated ahead is lost ({type(e).__name__}); generating it "
                          "again with the current weights", flush=True)
                    ahead = None
            ref, rm = rl.rollout(ctx, rows, step, weights_version=version)
            m.update(rm)
            rewards, wm = rl.reward(ref, rows)
            m.update(wm)
            break
        except RayError as e:
            if actor_error(e) is None or retries >= ctx.rollout_max_restarts:
                raise
            lost = rl.recover_engines(ctx, e)  # re-raises unless an engine died and came back
            retries, waited = retries + 1, waited + lost["wait_s"]
            print(f"step {step}: rollout engine(s) {', '.join(lost['engines'])} died ({type(e).__name__}); "
                  f"restarted in {lost['wait_s']:.1f}s, redoing refit + rollout (retry {retries})", flush=True)
    m["fault/rollout_retries"], m["time/engine_restart_wait_s"] = float(retries), waited
    return ref, rewards, m, version


def _submit_ahead(ctx: RunContext, next_rows: dict[int, list[dict]], aheads: dict[int, Ahead],
                  version: int) -> list[tuple[int, Any]]:
    """Start the rollouts of the steps in ``next_rows`` not generated yet, one after the other on the engines
    (Prefect tasks in threads), with the weights of ``version`` (loaded by this step's refit)."""
    futures, prev = [], None
    for t in sorted(next_rows):
        if t in aheads:
            continue
        task = rl.rollout.with_options(task_run_name=f"rollout-step-{t}")
        prev = task.submit(ctx, next_rows[t], t, weights_version=version, wait_for=[prev] if prev else None)
        futures.append((t, prev))
    return futures


def _collect_ahead(ctx: RunContext, step: int, futures: list[tuple[int, Any]], aheads: dict[int, Ahead],
                   version: int, m: dict) -> list[tuple[float, float]]:
    """Wait for the rollouts started ahead (the engines are idle when the step returns, so the next refit never
    lands mid-rollout) and keep them in ``aheads``; a rollout whose engine died is dropped (its step generates it
    again) after the engine is back. Returns their (start, end) wall-clock spans."""
    spans, failed = [], False
    for t, fut in futures:
        try:
            ref, rm = fut.result()
        except Exception as e:  # an engine died while generating ahead (or an earlier one did: this one never ran)
            if failed:
                continue
            if isinstance(e, RayError) and actor_error(e) is not None:
                failed = True
                lost = rl.recover_engines(ctx, e)
                m["fault/rollout_retries"] = m.get("fault/rollout_retries", 0.0) + 1
                m["time/engine_restart_wait_s"] = m.get("time/engine_restart_wait_s", 0.0) + lost["wait_s"]
                print(f"step {step}: rollout engine(s) {', '.join(lost['engines'])} died generating step {t} ahead "
                      f"({type(e).__name__}); restarted in {lost['wait_s']:.1f}s; step {t} generates it again",
                      flush=True)
            else:
                raise
            continue
        spans.append((rm.pop("time/rollout_start_unix"), rm.pop("time/rollout_end_unix")))
        aheads[t] = Ahead(step=t, ref=ref, metrics=rm, version=version)
    return spans


@flow(name="rl_step", log_prints=False, validate_parameters=False)
def rl_step(ctx: RunContext, rows: list[dict], step: int, kv_scales: dict | None = None,
            aheads: dict[int, Ahead] | None = None,
            next_rows: dict[int, list[dict]] | None = None) -> tuple[dict, dict | None, dict[int, Ahead]]:
    """One RL step; ``kv_scales``: the FP8 KV scales to load with this step's refit (from the last calibration).
    Asynchronous: ``aheads`` holds the rollouts generated by earlier steps, ``next_rows`` the rows of the steps to
    generate ahead now (none: synchronous). Returns (metrics, the KV scales for the next refit, the rollouts ahead)."""
    t0 = time.perf_counter()
    aheads = dict(aheads or {})
    ahead = aheads.pop(step, None)
    ref, rewards, m, version = _generate(ctx, rows, step, kv_scales, ahead)
    m.pop("time/rollout_start_unix", None)
    m.pop("time/rollout_end_unix", None)
    refit_version = int(m["refit/weights_version"])
    m["async/trajectory_age_mean"] = m["async/trajectory_age_max"] = float(step - 1 - version)
    futures = _submit_ahead(ctx, next_rows or {}, aheads, refit_version)
    t_train = time.time()
    tm = rl.train(ctx, ref, rewards, step)  # logs its own metrics
    m.update(tm)
    new_scales, cm = rl.calibrate(ctx, ref, step)
    m.update(cm)
    train_span = (t_train, time.time())
    spans = _collect_ahead(ctx, step, futures, aheads, refit_version, m) if futures else []
    step_s = time.perf_counter() - t0
    m["time/step_s"] = step_s
    for phase in PHASES:
        m[f"time/share_{phase}"] = m.get(f"time/{phase}_s", 0.0) / step_s
    m["time/share_calibration"] = (m.get("time/calibrate_s", 0.0) + m.get("time/clip_calibration_s", 0.0)) / step_s
    # Orchestration: the step's wall time not spent in the workers' own work (Prefect task/subflow overhead, Ray
    # calls and transfers of the rollout and train tasks, MLflow logging inside the tasks). Refit and KV calibration
    # are their own budget line (time/share_refit_kv). A rollout generated ahead ran during an earlier step: the
    # engines' time in this one is the rollout generated now (if any) plus the rollouts ahead, which overlap training.
    trainer_s = m.get("time/policy_train_s", 0.0) + m.get("time/calibrate_s", 0.0)
    ahead_s = sum(b - a for a, b in spans)
    own_rollout_s = m.get("time/rollout_engine_max_s", 0.0) if version == refit_version else 0.0  # generated now
    worker_s = m.get("time/refit_s", 0.0) + m.get("time/reward_s", 0.0) + own_rollout_s + max(trainer_s, ahead_s)
    m["time/orchestration_s"] = max(step_s - worker_s, 0.0)
    m["time/share_orchestration"] = m["time/orchestration_s"] / step_s
    m["time/share_refit_kv"] = (m.get("time/refit_s", 0.0) + m.get("time/calibrate_s", 0.0)) / step_s
    m["throughput/samples_per_s"] = len(rewards) / step_s
    if next_rows is not None:
        m["async/rollouts_ahead"] = float(len(aheads))
        m["async/rollout_ahead_s"] = ahead_s
        train_s, hidden_s = train_span[1] - train_span[0], _overlap(train_span, spans)
        m["async/train_overlap_frac"] = hidden_s / train_s if train_s > 0 else 0.0
        m["async/rollout_hidden_frac"] = hidden_s / ahead_s if ahead_s > 0 else 0.0
    log_metrics(ctx.tracking_uri, ctx.run_id, {k: v for k, v in m.items() if k not in tm}, step)
    return m, (new_scales if new_scales is not None else kv_scales), aheads
