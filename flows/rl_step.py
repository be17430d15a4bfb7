"""Subflow ``rl_step``: refit (weights + KV scales) -> rollout -> reward -> train -> calibrate, each a Prefect task.

A rollout engine that dies in refit, rollout or reward (Ray restarts it, ``cluster.rollout_max_restarts``) makes
the step wait for it and redo the three (same seeds: the same samples; nothing was trained or logged yet):
``fault/rollout_retries``, ``time/engine_restart_wait_s``. A dead trainer fails the step (flows/grpo.py stops the run).

Returns the step's metrics (and the KV scales for the next refit): everything the tasks reported plus ``time/step_s``, each task's share of the step
(``time/share_<task>``), the calibration share (KV scales + Calibrated Clipping), the orchestration overhead
(``time/orchestration_s``, ``time/share_orchestration``: step time not spent in the workers' own work), the refit +
KV-calibration share (``time/share_refit_kv``) and ``throughput/samples_per_s``."""

from __future__ import annotations

import time

from prefect import flow
from ray.exceptions import RayError

from cluster.runtime import actor_error
from tasks import rl
from tasks.context import RunContext
from tasks.tracking import log_metrics

PHASES = ("refit", "rollout", "reward", "train", "calibrate")


@flow(name="rl_step", log_prints=False, validate_parameters=False)
def rl_step(ctx: RunContext, rows: list[dict], step: int, kv_scales: dict | None = None) -> tuple[dict, dict | None]:
    """One RL step; ``kv_scales``: the FP8 KV scales to load with this step's refit (from the last calibration).
    Returns (metrics, the KV scales for the next refit: this step's calibration, else the ones it was given)."""
    t0 = time.perf_counter()
    m: dict[str, float] = {}
    retries, waited = 0, 0.0
    while True:  # refit -> rollout -> reward; redone when a rollout engine died in them (Ray restarts it)
        try:
            m.update(rl.refit(ctx, kv_scales))
            ref, rm = rl.rollout(ctx, rows, step, weights_version=int(m["refit/weights_version"]))
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
    tm = rl.train(ctx, ref, rewards, step)  # logs its own metrics
    m.update(tm)
    new_scales, cm = rl.calibrate(ctx, ref, step)
    m.update(cm)
    step_s = time.perf_counter() - t0
    m["time/step_s"] = step_s
    for phase in PHASES:
        m[f"time/share_{phase}"] = m.get(f"time/{phase}_s", 0.0) / step_s
    m["time/share_calibration"] = (m.get("time/calibrate_s", 0.0) + m.get("time/clip_calibration_s", 0.0)) / step_s
    # Orchestration: the step's wall time not spent in the workers' own work (Prefect task/subflow overhead, Ray
    # calls and transfers of the rollout and train tasks, MLflow logging inside the tasks). Refit and KV calibration
    # are their own budget line (time/share_refit_kv).
    worker_s = sum(m.get(k, 0.0) for k in ("time/refit_s", "time/rollout_engine_max_s", "time/reward_s",
                                            "time/policy_train_s", "time/calibrate_s"))
    m["time/orchestration_s"] = max(step_s - worker_s, 0.0)
    m["time/share_orchestration"] = m["time/orchestration_s"] / step_s
    m["time/share_refit_kv"] = (m.get("time/refit_s", 0.0) + m.get("time/calibrate_s", 0.0)) / step_s
    m["throughput/samples_per_s"] = len(rewards) / step_s
    log_metrics(ctx.tracking_uri, ctx.run_id, {k: v for k, v in m.items() if k not in tm}, step)
    return m, (new_scales if new_scales is not None else kv_scales)
