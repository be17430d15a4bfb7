"""Flow ``fp8-grpo``: one training run of a recipe.

    python -m flows.grpo configs/tiny_fp8_e2e.yaml [key=value ...]

Order: load + validate the recipe (bad keys/types/combinations fail here) -> the CPU line (fp8core.cpu.describe) ->
hub ids (``policy.model_name``, data keys ``ORG/NAME``) pinned to a commit in the Hugging Face cache (storage/hub.py;
one missing fails here, naming the key) -> embedded assets (bootstrap subflow) when the recipe says ``embedded`` ->
the rollout KV-cache check against the model's head size and the CPU (cluster.runtime.check_rollout_kv) -> load
the datasets (missing file/column, malformed line fails here, before any worker starts) -> Ray
(a local single-node Ray, or ``ray.address``) + the PolicyWorker and RolloutWorker actors -> resume from the latest
complete checkpoint (``checkpointing.resume``: same MLflow run, step counter continues) -> validation at step 0 ->
``rl_step`` subflows, validation every ``grpo.val_period`` steps, checkpoints every ``checkpointing.save_period``
steps and at the end -> summary + plot in MLflow; the terminal gets one line per step and, at the end, where the
MLflow run and the checkpoint are.

Parameters are the recipe path and override strings only (deployment-friendly); the flow returns a small summary.

From the command line a bad recipe or data file stops the run before any worker starts with one line on stderr and
exit status 2: ``config error: policy.optimizer.lr: must be > 0, got -1.0`` or
``data error: data/train.jsonl:5: not valid JSON: Expecting ',' delimiter (column 35)`` (file, line, what is wrong).
``FP8GRPO_DEBUG=1`` in the environment shows the full traceback instead.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __name__ == "__main__":  # before Prefect is imported
    from flows.cli_env import prefect_cli_env

    prefect_cli_env()

from prefect import flow  # noqa: E402

import process.quiet  # noqa: E402,F401  third-party start-up noise off before transformers / torchao / MLflow load
from configs.schema import EMBEDDED, Config, ConfigError, load_config, to_yaml  # noqa: E402
from flows.run_report import final_lines, progress_line, run_report, summarize, val_lines  # noqa: E402

if TYPE_CHECKING:
    from data.loading import PromptSource
    from tasks.context import RunContext


def _say(msg: str) -> None:
    print(msg, flush=True)


def resolve_paths(cfg: Config) -> tuple[Path, str | None]:
    run_dir = Path(cfg.run_dir).resolve()
    ck = cfg.checkpointing
    if not ck.enabled:
        return run_dir, None
    uri = ck.checkpoint_dir
    if "://" not in uri and not uri.startswith("/"):
        uri = str(run_dir / uri)
    return run_dir, uri


@dataclass
class _Run:
    """What one run of the flow carries from step to step: the recipe and its paths, then what each step adds."""

    cfg: Config
    run_dir: Path
    ck_uri: str | None  # checkpointing.checkpoint_dir resolved against run_dir; None when checkpointing is off
    t_start: float
    auth: Any = None  # Ray token auth (cluster.auth.ray_auth)
    caps: Any = None  # this (driver) node's CPU (fp8core.cpu.cpu_caps); each actor reports its own
    cpu: dict = field(default_factory=dict)  # summary's cpu_* keys: the driver's, then the actors' kinds once up
    model_dir: Any = None  # the local Hugging Face model directory (embedded assets / hub snapshot resolved)
    hub: dict = field(default_factory=dict)  # key -> storage.hub.Snapshot of each hub id the recipe names
    data: PromptSource | None = None
    val_rows: list = field(default_factory=list)
    eval_rows: dict = field(default_factory=dict)
    start_step: int = 0  # the resumed checkpoint's step, else 0
    resume_state: dict | None = None
    uri: str | None = None  # MLflow tracking URI (None: MLflow off)
    run_id: str | None = None
    started_ray: bool = False
    workers: Any = None
    ctx: RunContext | None = None
    hooks: Any = None  # TEST-ONLY (process.faults.TestHooks), None unless testing.* keys are set
    kv_scales: dict | None = None  # FP8 KV cache: the last calibration's scales, handed to every refit
    status: str = "FAILED"
    val_acc: dict[int, float] = field(default_factory=dict)
    val_metrics: dict[int, dict] = field(default_factory=dict)  # step -> val/* metrics of every set validated then
    val_files: dict[str, dict[int, str]] = field(default_factory=dict)  # set -> step -> val/<set>/step_XXXXXX.jsonl
    last_ck: str | None = None
    history: list[dict] = field(default_factory=list)  # each step's metrics


@flow(name="fp8-grpo", log_prints=False, validate_parameters=True)
def grpo(config_path: str, overrides: list[str] | None = None) -> dict:
    import ray

    from cluster.runtime import init_ray, stop_workers
    from process.signals import redeliver_swallowed_stop_signals
    from process.watchdog import start_watchdog

    start_watchdog()  # after this process ends (even by kill -9), whatever it started is ended too
    redeliver_swallowed_stop_signals()  # a SIGTERM whose exception a finalizer swallowed is sent again

    run = _open_run(config_path, overrides)
    _assets_and_data(run)
    _resume_point(run)
    _open_mlflow_run(run)
    try:
        run.started_ray = init_ray(run.cfg, run.run_dir, run.auth)
        _start_workers(run)
        _initial_kv_scales(run)
        if run.cfg.grpo.val_at_start and run.start_step == 0:
            _run_validation(run, 0)
        _train(run)
        run.status = "FINISHED"
    except BaseException as e:  # SIGTERM (Prefect's TerminationSignal), Ctrl-C, a cancel: fast cleanup, run KILLED
        if cancelled(e):
            run.status = "KILLED"
            _say(f"fp8-grpo: {type(e).__name__} (a cancel or a stop signal): stopping the workers and Ray")
        raise
    finally:
        try:
            stop_workers(run.workers, graceful=run.status == "FINISHED")
        finally:
            if run.started_ray:
                ray.shutdown()
        summary = _finish(run)
    _say(final_lines(summary))
    return summary


def preflight(cfg: Config, run_dir: Path | None = None) -> tuple[dict, Any]:
    """The checks a recipe passes before any work, each failing in one line that names the key (ConfigError or
    ValueError): the evaluation sets' local files, the hub ids pinned in the Hugging Face cache and the model
    directory (storage.hub.resolve_config), the Ray token file, ``cluster.pin_cpus`` against this machine's CPUs.
    The command line runs them before Prefect starts; the flow runs them again at its start, with ``run_dir`` (where
    a local Ray's token is kept). Returns (the pinned hub snapshots by key, the Ray token auth or None)."""
    from cluster.auth import ray_auth
    from cluster.runtime import cpu_pins
    from data.eval_sets import check_eval_paths
    from storage.hub import resolve_config

    check_eval_paths(cfg)
    hub = resolve_config(cfg)
    if run_dir is not None:
        auth = ray_auth(cfg, run_dir)
    else:  # the command line: only a cluster's token file is read (no side effects before the run starts)
        auth = ray_auth(cfg, Path(cfg.run_dir)) if cfg.ray.address or cfg.ray.auth_token_path else None
    cpu_pins(cfg)
    return hub, auth


def _open_run(config_path: str, overrides: list[str] | None) -> _Run:
    """Load + validate the recipe (bad keys/types/combinations fail here), make the run dir (the run's environment,
    Ray token auth, config.resolved.yaml), check the evaluation-set paths and print the recipe and CPU lines."""
    from fp8core.cpu import cpu_caps
    from fp8core.gemm import describe
    from process.env import apply_env

    t_start = time.perf_counter()
    cfg = load_config(config_path, list(overrides or []))
    run_dir, ck_uri = resolve_paths(cfg)
    run = _Run(cfg=cfg, run_dir=run_dir, ck_uri=ck_uri, t_start=t_start)
    run_dir.mkdir(parents=True, exist_ok=True)
    apply_env(run_dir, allow_downloads=cfg.hub.allow_downloads)
    run.hub, run.auth = preflight(cfg, run_dir)  # what the command line checked, again: the flow may run alone
    (run_dir / "config.resolved.yaml").write_text(to_yaml(cfg))
    _say(f"fp8-grpo: recipe {cfg.recipe} ({cfg.precision_tag}), run dir {run_dir}")
    run.caps = cpu_caps()  # this (driver) node; each actor reports its own below
    run.cpu = {"cpu_kind": run.caps.kind, "cpu_model": run.caps.model, "cpu_cap": run.caps.cap}
    _say(describe())
    return run


def _assets_and_data(run: _Run) -> None:
    """Assets and data, all before any worker starts: hub ids pinned (a name the cache lacks fails here), the
    embedded assets (bootstrap subflow) where the recipe says ``embedded``, the model directory, the rollout KV-cache
    check, the training, validation and evaluation sets (a missing file or column fails here), then the TEST-ONLY
    fault warnings."""
    from cluster.runtime import check_rollout_kv
    from data.eval_sets import load_eval_sets
    from data.loading import PromptSource
    from data.prompt import PromptFormat
    from flows.bootstrap import bootstrap_flow

    cfg = run.cfg
    hub = run.hub  # each hub id pinned to the commit its revision points to now (preflight)
    model_dir = str(hub["policy.model_name"].path) if "policy.model_name" in hub else cfg.policy.model_name
    # hub datasets travel as ORG/NAME@<commit>: the loader reads exactly the pinned snapshot
    train_path = hub["data.train_path"].pinned if "data.train_path" in hub else cfg.data.train_path
    val_path = hub["data.validation_path"].pinned if "data.validation_path" in hub else cfg.data.validation_path
    if EMBEDDED in (model_dir, train_path, val_path):
        assets = bootstrap_flow(cfg.bootstrap.assets_dir, cfg.bootstrap.sft_steps,
                                cfg.bootstrap.warm_start_seed(cfg.grpo.seed), cfg.data.task,
                                cfg.bootstrap.model, cfg.bootstrap.model_size())
        model_dir = assets["model_dir"] if model_dir == EMBEDDED else model_dir
        train_path = assets["train"] if train_path == EMBEDDED else train_path
        val_path = assets["validation"] if val_path == EMBEDDED else val_path
    if not Path(model_dir).is_dir():
        raise ConfigError(f"policy.model_name: {model_dir} is neither a local Hugging Face model directory nor a hub "
                          "id ORG/NAME")
    run.model_dir = model_dir
    kv_mode, kv_reason = check_rollout_kv(cfg, Path(model_dir))  # ConfigError where vLLM would refuse the KV cache
    if cfg.policy.generation.vllm_cfg.kv_fp8:
        _say(f"rollout FP8 KV cache: {kv_mode} ({kv_reason})")
    run.data = PromptSource.from_config(cfg.data, train_path=train_path, validation_path=val_path,
                                        seed=cfg.grpo.seed, allow_downloads=cfg.hub.allow_downloads)
    run.val_rows = run.data.validation_rows(cfg.grpo.max_val_samples)
    run.eval_rows = load_eval_sets(cfg)  # evaluation.sets: a missing file / column fails here, naming the key
    PromptFormat.from_config(cfg.data)  # data.system_prompt_file / prompt_file: a missing file fails here too
    from process.faults import TestHooks

    run.hooks = TestHooks.from_config(cfg, run.run_dir)  # TEST-ONLY faults (None in a real run): loud warnings
    for line in run.hooks.announcements() if run.hooks is not None else ():
        _say(line)


def _resume_point(run: _Run) -> None:
    """With ``checkpointing.resume``: the latest complete checkpoint's step and state (read before MLflow, so that
    the same MLflow run is reopened); the run starts at step 0 when there is none."""
    from storage.checkpoint import CheckpointStore

    ck_cfg = run.cfg.checkpointing
    if ck_cfg.resume:
        store = CheckpointStore(run.ck_uri, endpoint_url=ck_cfg.s3_endpoint_url)
        latest = store.latest_step()
        if latest is not None:
            run.resume_state = store.load_state(latest)
            run.start_step = latest
            _say(f"resume: checkpoint {store.step_uri(latest)} (step {latest})")
        else:
            _say(f"resume: no complete checkpoint under {run.ck_uri}; starting at step 0")


def _open_mlflow_run(run: _Run) -> None:
    """With ``logger.mlflow_enabled``: start the MLflow run (the resumed checkpoint's run when there is one) and log
    the resolved recipe to it."""
    from tasks.tracking import log_text, start_run, tracking_uri

    cfg = run.cfg
    run.uri = tracking_uri(cfg, run.run_dir) if cfg.logger.mlflow_enabled else None
    if run.uri:
        pinned = {f"hub/{key}": snap.pinned for key, snap in run.hub.items()}  # ORG/NAME@<commit> read by the run
        run.run_id = start_run(cfg, run.uri, run_id=(run.resume_state or {}).get("mlflow_run_id"),
                               extra_params={**run.caps.as_params(), **pinned})
        log_text(run.uri, run.run_id, to_yaml(cfg), "config.resolved.yaml")
        if run.resume_state is not None:
            from tasks.tracking import mark_replayed

            replayed = mark_replayed(run.uri, run.run_id, run.start_step)
            if replayed:
                _say(f"resume: steps {replayed[0]}-{replayed[-1]} were logged by the stopped run after its last "
                     "checkpoint; they run again and keep their first values in MLflow (each step once)")


def _start_workers(run: _Run) -> None:
    """Start the PolicyWorker and RolloutWorker actors, print what came up (and on which CPU kinds), tag the MLflow
    run with the kinds and build the RunContext the tasks share."""
    from cluster.runtime import get, start_workers, worker_nodes
    from tasks.context import RunContext
    from tasks.tracking import set_tags

    cfg, uri, run_id = run.cfg, run.uri, run.run_id
    t0 = time.perf_counter()
    workers = run.workers = start_workers(cfg, _worker_model(run), run.run_dir, tag=uuid.uuid4().hex[:8],
                                          hooks=run.hooks)
    info = get(workers.policy.info.remote())
    r_stats, p_cpu = get([workers.rollout.stats.remote(), workers.policy.cpu.remote()])
    _say(f"workers up in {time.perf_counter() - t0:.1f}s: policy {info['num_params'] / 1e6:.2f}M params "
         f"({info['fp8_layers']} FP8 linears, CPU kind {p_cpu['kind']}) x {len(workers.policies)} trainer(s), rollout {len(workers.rollouts)} x vLLM "
         f"{cfg.policy.generation.vllm_cfg.precision} kv={r_stats['kv_mode']} (CPU kind {r_stats['cpu']['kind']}); "
         f"on {worker_nodes(workers)} Ray node(s)")
    want = (cfg.policy.threads, cfg.policy.generation.vllm_cfg.threads)
    if (info["threads"], r_stats["threads"]) != want:
        _say(f"threads: trainer {info['threads']} of policy.threads={want[0]}, rollout {r_stats['threads']} of "
             f"vllm_cfg.threads={want[1]} (at most one per CPU the actor may run on)")
    # Tags, not params: a resumed run may land on another CPU (params are immutable in MLflow).
    run.cpu.update(cpu_kind=p_cpu["kind"], cpu_rollout_kind=r_stats["cpu"]["kind"], kv_mode=r_stats["kv_mode"])
    set_tags(uri, run_id, {"cpu/kind": run.caps.kind, "cpu/rollout_kind": r_stats["cpu"]["kind"],
                           "cpu/policy_kind": p_cpu["kind"], "cpu/cap": run.caps.cap or "none",
                           "rollout/kv_mode": r_stats["kv_mode"], "policy/bf16_mode": info["bf16_mode"],
                           "rollout/bf16_mode": r_stats["bf16_mode"], "cluster/nodes": worker_nodes(workers)})
    run.ctx = RunContext.from_config(cfg, policy=workers.policy_name, rollouts=workers.rollout_names, run_id=run_id,
                                     tracking_uri=uri, model_dir=str(run.model_dir), checkpoint_uri=run.ck_uri,
                                     policy_ranks=workers.policy_names, hooks=run.hooks)


def _worker_model(run: _Run) -> str:
    """What the workers load: the model directory, except a hub model on a ``ray.address`` cluster, which goes as
    ORG/NAME@<commit> for each node to resolve in its own Hugging Face cache (storage/hub.py)."""
    snap = run.hub.get("policy.model_name")
    return snap.pinned if snap is not None and run.cfg.ray.address else str(run.model_dir)


def _initial_kv_scales(run: _Run) -> None:
    """FP8 KV cache: the resumed checkpoint's KV scales, or on a first start the scales calibrated from the starting
    policy on a first batch of rollouts."""
    from tasks import rl
    from tasks.checkpoint import load_checkpoint

    if run.resume_state is not None:
        run.kv_scales = load_checkpoint(run.ctx, run.start_step).get("kv_scales")
    elif run.ctx.kv_fp8:  # initial KV scales from the starting policy on a first batch of rollouts
        rl.refit(run.ctx)
        ref, _ = rl.rollout(run.ctx, run.data.train_rows(0, run.cfg.grpo.num_prompts_per_step), 0)
        run.kv_scales, _ = rl.calibrate(run.ctx, ref, 0)


def _train(run: _Run) -> None:
    """The RL steps after the resume point up to ``grpo.max_num_steps``: an ``rl_step`` subflow each, validation
    every ``grpo.val_period`` steps and at the last, the step's progress line, and a checkpoint every
    ``checkpointing.save_period`` steps and at the last (not after a step that skipped a non-finite update)."""
    from cluster.runtime import lost_trainers
    from flows.rl_step import rl_step
    from tasks.checkpoint import save_checkpoint

    cfg, ck_cfg = run.cfg, run.cfg.checkpointing
    ag = cfg.grpo.async_grpo
    skipped_before = 0.0
    aheads: dict = {}  # asynchronous: step -> its rollout generated ahead (flows/rl_step.py); lost on a stop, by design

    def rows_of(t: int) -> list[dict]:
        return run.data.train_rows(t - 1, cfg.grpo.num_prompts_per_step)

    for step in range(run.start_step + 1, cfg.grpo.max_num_steps + 1):
        ahead_steps = range(step + 1, min(step + ag.max_trajectory_age_steps, cfg.grpo.max_num_steps) + 1)
        next_rows = {t: rows_of(t) for t in ahead_steps if t not in aheads} if ag.enabled else None
        try:
            m, run.kv_scales, aheads = rl_step(run.ctx, rows_of(step), step, run.kv_scales, aheads, next_rows)
        except Exception as e:  # a dead trainer rank (any error: probe them): stop now with what to do, no traceback
            lost = lost_trainers(e, run.ctx.trainers)
            if not lost:
                raise
            raise _worker_lost(run, lost, step, e) from e
        m["time/step_end_unix"] = time.time()  # summary.json's step_interval_s (not logged: the subflow logged m)
        run.history.append(m)
        last = step == cfg.grpo.max_num_steps
        if (cfg.grpo.val_period and step % cfg.grpo.val_period == 0) or last:
            _run_validation(run, step)
        _say(progress_line(step, cfg.grpo.max_num_steps, m, run.val_acc.get(step)))
        skipped_now = m.get("train/skipped_updates", 0.0) - skipped_before
        skipped_before = m.get("train/skipped_updates", 0.0)
        if run.ck_uri and (step % ck_cfg.save_period == 0 or last):
            if skipped_now > 0:
                _say(f"step {step}: {int(skipped_now)} non-finite update(s) skipped; checkpoint not written")
            else:
                run.last_ck = save_checkpoint(run.ctx, step)
                if cfg.logger.plot and not last:  # the curves so far, beside the checkpoint (the end redraws them)
                    _update_curves(run)


def _update_curves(run: _Run) -> None:
    from tasks.tracking import plot_curves

    try:
        plot_curves(run.uri, run.run_id)
    except Exception as e:  # noqa: BLE001  a figure must not stop training
        _say(f"fp8-grpo: curves.png not updated ({type(e).__name__}: {e})")


def _worker_lost(run: _Run, lost: list[str], step: int, e: BaseException) -> Exception:
    """The WorkerLost to stop the run with when trainer ranks died in ``step``: which ones, and where to resume from
    (the last complete checkpoint, else the start); its message is printed too."""
    from cluster.runtime import WorkerLost
    from storage.checkpoint import CheckpointStore

    ck_uri, ck_cfg = run.ck_uri, run.cfg.checkpointing
    done = CheckpointStore(ck_uri, endpoint_url=ck_cfg.s3_endpoint_url).latest_step() if ck_uri else None
    where = (f"the last complete checkpoint is step {done} under {ck_uri}: rerun the same command with "
             "checkpointing.resume=true to continue from it" if done is not None else
             "no complete checkpoint was written yet: rerun from the start")
    msg = (f"policy worker(s) {', '.join(lost)} died during step {step} ({type(e).__name__}); the run "
           f"stops and its other workers are ended; {where}")
    _say(f"fp8-grpo: {msg}")
    return WorkerLost(msg)


def _run_validation(run: _Run, step: int) -> None:
    """Validate at ``step``: the main set, the evaluation sets due now and, when due, the sampled evaluation (the
    "ends" sets and sampling run at step 0 and the last step only). Records the step's accuracy and val/* metrics,
    writes each set's per-prompt results to run_dir/val/<set>/step_XXXXXX.jsonl and MLflow (paired comparisons
    across runs), logs the kept samples, and prints the validation lines at the first and the last validation."""
    from tasks import rl
    from tasks.tracking import log_text

    cfg, uri, run_id = run.cfg, run.uri, run.run_id
    ends = step in (0, cfg.grpo.max_num_steps)  # evaluation.*: "ends" sets / sampling run only here
    sets = {"main": run.val_rows, **{s.name: run.eval_rows[s.name] for s in cfg.evaluation.sets
                                     if s.when == "period" or ends}}
    sampled = cfg.evaluation.num_samples > 0 and (cfg.evaluation.sampled_when == "period" or ends)
    out = rl.validate(run.ctx, sets, step, kv_scales=run.kv_scales, sampled=sampled,
                      num_samples_to_keep=cfg.logger.num_val_samples_to_print)
    m = out["metrics"]
    run.val_acc[step] = m["val/accuracy"]
    run.val_metrics[step] = {k: v for k, v in m.items() if k.startswith("val/") or k.startswith("time/validate")}
    for name, recs in out["records"].items():  # per-prompt results: paired comparisons across runs
        path = run.run_dir / "val" / name / f"step_{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r) + "\n" for r in recs)
        path.write_text(text)
        run.val_files.setdefault(name, {})[step] = str(path)
        log_text(uri, run_id, text, f"val/{name}/step_{step:06d}.jsonl")
    log_text(uri, run_id, json.dumps(out["samples"], indent=1), f"samples/val_step_{step:06d}.json")
    if step == run.start_step or ends:
        _say(val_lines(step, cfg, m, list(sets)))


def _finish(run: _Run) -> dict:
    """The run's summary (also after a failure): written to run_dir/summary.json and, with MLflow, its summary/*
    metrics and the end of the MLflow run (status, summary, plot)."""
    from tasks.tracking import client, finish_run, log_metrics, ui_hint, ui_url

    cfg, uri, run_id, val_metrics = run.cfg, run.uri, run.run_id, run.val_metrics
    summary = summarize(cfg, run.history, run.val_acc, run.start_step, run.last_ck, uri, run_id,
                       time.perf_counter() - run.t_start)
    summary.update(run.cpu)  # cpu_kind: where the trainer ran (the regression's throughput floor is per kind)
    val_s = sum(v.get("time/validate_s", 0.0) for v in val_metrics.values())
    summary.update(val_files=run.val_files, val_metrics=val_metrics, validate_s_total=val_s,
                   validate_share=val_s / summary["wall_s"] if summary["wall_s"] else None,
                   testing_fault_val_accuracy_drop=run.hooks.val_accuracy_drop if run.hooks else 0.0)
    if uri and run_id:  # the link opens MLflow's model-training view on this run's charts (tasks/tracking.py)
        exp = client(uri).get_run(run_id).info.experiment_id
        summary.update(mlflow_experiment_id=exp, mlflow_ui_url=ui_url(uri, exp, run_id),
                       mlflow_ui_command=ui_hint(uri))
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    report = run_report(cfg, summary, val_metrics)
    _publish_artifact(run, report)
    if uri and run_id:
        if run.val_acc:
            log_metrics(uri, run_id, {"summary/val_accuracy_start": summary["val_accuracy_start"] or 0.0,
                                      "summary/val_accuracy_end": summary["val_accuracy_end"] or 0.0,
                                      "summary/validate_s": summary["validate_s_total"],
                                      "summary/validate_share": summary["validate_share"] or 0.0},
                        cfg.grpo.max_num_steps)
        finish_run(uri, run_id, status=run.status, summary=summary, plot=cfg.logger.plot,
                   report=report)
    return summary


def _publish_artifact(run: _Run, report: str) -> None:
    """The run's report (:func:`run_report`) as a Prefect markdown artifact of this flow run (the Prefect UI's
    Artifacts tab); a Prefect API that refuses it costs a printed line, not the run."""
    try:
        from prefect.artifacts import create_markdown_artifact

        key = "fp8-grpo-" + "".join(c if c.isalnum() else "-" for c in run.cfg.recipe.lower())
        create_markdown_artifact(report, key=key[:100],
                                 description=f"fp8-grpo run of {run.cfg.recipe}: accuracy, mismatch, step time")
    except Exception as e:  # noqa: BLE001  reporting must not fail a finished run
        _say(f"fp8-grpo: the Prefect artifact was not written ({type(e).__name__}: {e})")


def cancelled(e: BaseException) -> bool:
    """Whether ``e`` ended the run because it was stopped (its MLflow run is then KILLED, not FAILED): a stop signal
    (SIGTERM as Prefect's TerminationSignal or our SystemExit, Ctrl-C) anywhere in the exception's chain, a
    cancelled Prefect run (CancelledRun), or a cancel the Prefect runner announced before its SIGTERM. The last one
    matters because the signal does not always surface as itself: in one CI run (AVX2 machine) a cancelled deployment
    run reached this handler as an ordinary Exception and was recorded FAILED. Which path turned it into one was not
    identified for certain (a candidate, since fixed: the signal raised inside Ray's blocking wait, which maps only
    KeyboardInterrupt/SystemExit; the driver now waits in Python, cluster.runtime.wait)."""
    from prefect.exceptions import CancelledRun

    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, CancelledRun) or not isinstance(x, Exception):
            return True
        x = x.__cause__ or x.__context__
    try:  # Prefect's own record of the runner's cancel request (what its engine uses to tell cancel from crash)
        from prefect._internal.control_listener import get_intent
    except ImportError:  # another Prefect version: the exception chain above is all we have
        return False
    return get_intent() == "cancel"


DEBUG_ENV = "FP8GRPO_DEBUG"  # =1: config / data errors raise with their traceback instead of one line


class _DropErrors(logging.Filter):
    """Drops a log record carrying one of ``types`` as its exception: Prefect logs a failing flow's exception with
    its traceback; the CLI prints those errors as one line itself."""

    def __init__(self, types: tuple[type[BaseException], ...]):
        super().__init__()
        self.types = types

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.types))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from data.loading import DataError, check_local_files
    from fp8core.cpu import apply_cpu_cap

    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")

    try:
        cfg = load_config(argv[0], argv[1:])  # fail fast with the dotted path, before Prefect starts its server
        preflight(cfg)
        # local data files: a missing file or a bad line fails here too, in seconds rather than after the server
        check_local_files(cfg.data, {"data.train_path": cfg.data.train_path,
                                     "data.validation_path": cfg.data.validation_path})
        # A fresh process: the driver (bootstrap SFT, data) follows FP8GRPO_CPU_CAP too. The flow function itself
        # does not patch its process (it may be a long-lived one); the actors always apply the cap themselves.
        apply_cpu_cap()
    except (ConfigError, ValueError) as e:
        if debug:
            raise
        print(f"{'data' if isinstance(e, DataError) else 'config'} error: {e}", file=sys.stderr)
        return 2
    # SIGTERM -> SystemExit: the flow's cleanup runs (Prefect turns the signal into TerminationSignal inside the
    # flow, then re-sends it to this handler), atexit handlers run (Prefect's temporary server is stopped)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Errors the flow finds before any worker starts (a data file, the KV-cache check, a prompt file): one line too
    one_line = (DataError, ConfigError)
    if not debug:
        for name in ("prefect.flow_runs", "prefect.task_runs"):
            logging.getLogger(name).addFilter(_DropErrors(one_line))
    try:
        grpo(argv[0], argv[1:])
    except one_line as e:
        if debug:
            raise
        print(f"{'data' if isinstance(e, DataError) else 'config'} error: {e}", file=sys.stderr)
        return 2
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
