"""MLflow helpers used by tasks and flows: explicit run ids (MlflowClient), so logging works from Prefect's task
threads (the fluent API's active run is thread-local) and a resumed run logs into the same MLflow run."""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from process.signals import signals_held

_SECRET = re.compile(r"(secret|password|token|credential|access_key|session_key)", re.I)


def tracking_uri(cfg, run_dir: Path) -> str:
    """logger.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else a sqlite file under the run dir."""
    return cfg.logger.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


# MLflow 3.17's UI opens either its GenAI view ("Evaluation runs", the default) or its model-training view. It takes
# the choice from the URL's ``workflowType`` parameter before the one stored in the browser (mlflow/server/js build,
# main.*.js: ``e.get("workflowType")`` is used when it is "genai" or "machine_learning", else the local-storage key
# "mlflow.workflowType"), and the experiment page reads the experiment tag ``mlflow.experimentKind``. Every link we
# print carries the parameter, and experiments we create carry the tag, so they open on training runs and charts.
UI_QUERY = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
LOCAL_UI = "http://127.0.0.1:5000"


def ui_base(uri: str | None) -> str | None:
    """The UI address for a tracking URI: the server itself for http(s), else where ``mlflow ui`` serves by default."""
    if not uri:
        return None
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI


def ui_url(uri: str | None, experiment_id: str | None, run_id: str | None = None) -> str | None:
    """A link that opens a run's metric charts (or an experiment's runs) in the model-training view."""
    base = ui_base(uri)
    if base is None or experiment_id is None:
        return None
    path = f"/#/experiments/{experiment_id}/runs" + (f"/{run_id}/model-metrics" if run_id else "")
    return f"{base}{path}?{UI_QUERY}"


def ui_hint(uri: str | None) -> str:
    """How to get the UI up for a local store (empty for a server URI)."""
    if not uri or uri.startswith(("http://", "https://")):
        return ""
    return f".venv/bin/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri {uri}"


def artifact_location(uri: str) -> str | None:
    """Where a new experiment's artifacts go: next to a sqlite database (``<db dir>/mlartifacts``), so a run's
    artifacts stay with its tracking store; MLflow's own default there is ``./mlruns`` of whatever directory the
    process runs in, shared by every database. None (the server's choice) for a tracking server."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None


def experiment_id(c, name: str) -> str:
    """The id of experiment ``name``, created when missing; tagged as a model-training experiment unless it already
    has an ``mlflow.experimentKind``."""
    exp = c.get_experiment_by_name(name)
    if exp is None:
        return c.create_experiment(name, artifact_location=artifact_location(c.tracking_uri),
                                   tags=dict([EXPERIMENT_KIND_TAG]))
    if EXPERIMENT_KIND_TAG[0] not in exp.tags:  # an older experiment of ours: tag it once (never overwrite a choice)
        c.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND_TAG)
    return exp.experiment_id


def client(uri: str):
    """An MlflowClient for ``uri``; on a database store (sqlite, postgresql, mysql, ...) a stop signal does not
    interrupt its calls (:class:`_HeldWrites`)."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    return _HeldWrites(c) if _is_database(uri) else c


def _is_database(uri: str) -> bool:
    scheme = uri.split(":", 1)[0].lower() if ":" in uri else ""
    return scheme.split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")


class _HeldWrites:
    """An MlflowClient whose calls run with stop signals held (all but ``download_*``, which copy artifact files
    and touch no database). MLflow's database store rolls a session back on ``Exception`` only: a stop signal raised
    inside a write (Prefect's TerminationSignal, KeyboardInterrupt) left its transaction open, and the run's own last
    write -- marking the MLflow run KILLED -- then failed with sqlite's "database is locked" after ~20 s, leaving the
    run RUNNING. A database call takes milliseconds, so the signal waits that long."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr) or name.startswith("download_"):
            return attr

        @functools.wraps(attr)
        def held(*args, **kwargs):
            with signals_held():
                return attr(*args, **kwargs)

        return held


def start_run(cfg, uri: str, *, run_id: str | None = None, extra_params: Mapping[str, str] | None = None) -> str:
    """Create the run (params = flattened resolved config + ``extra_params``, e.g. the driver's ``cpu/*`` from
    fp8core.cpu.CpuCaps.as_params; tags = recipe/precision) or reopen ``run_id`` (params untouched)."""
    from mlflow.entities import Param, RunTag

    c = client(uri)
    if run_id:
        c.update_run(run_id, status="RUNNING")
        return run_id
    name = cfg.logger.mlflow.experiment_name
    exp_id = experiment_id(c, name)
    tags = {"recipe": cfg.recipe, "precision": cfg.precision_tag,
            "fp8_recipe": cfg.policy.megatron_cfg.fp8_cfg.fp8_recipe if cfg.policy.megatron_cfg.fp8_cfg.enabled
            else "none", "kv_cache_dtype": cfg.policy.generation.vllm_cfg.kv_cache_dtype}
    faults = [f"testing.{k}={v}" for k, v in sorted(asdict(cfg.testing).items()) if v]
    if faults:  # a TEST-ONLY fault run is marked as such in the UI (configs/sections.py TestingCfg)
        tags["testing.fault"] = " ".join(faults)
    run = c.create_run(exp_id, run_name=cfg.logger.mlflow.run_name or f"{cfg.recipe}", tags=tags)
    flat = {**cfg.flat(), **dict(extra_params or {})}
    params = [Param(k, str(v)[:6000]) for k, v in sorted(flat.items()) if not _SECRET.search(k)]
    for i in range(0, len(params), 100):
        c.log_batch(run.info.run_id, params=params[i:i + 100])
    c.log_batch(run.info.run_id, tags=[RunTag("mlflow.note.content", RUN_NOTE.format(recipe=cfg.recipe))])
    return run.info.run_id


RUN_NOTE = """fp8-grpo recipe {recipe}

Where to look (Model metrics tab; type a prefix in its search box):
- **val/accuracy**: greedy validation accuracy of the main set (`val/accuracy_lo` / `_hi`: Wilson 95% CI);
  `val/<set>/accuracy` per evaluation set, `val/main/pass_at_k` / `avg_at_k` where sampled
- **throughput/** rollout and train tokens/s; **time/step_s** and the `time/share_*` split
- **mismatch/token_mult_prob_error**: train/inference mismatch (1.0 = none); `is/*`, `clip/*`
- Artifacts: `curves.png` (accuracy with CIs, reward, throughput, mismatch, clip fractions, entropy; updated at
  every checkpoint), `summary.json`, `val/<set>/step_XXXXXX.jsonl` (per-prompt results)
"""


_REPLAYED: dict[str, set[tuple[str, int]]] = {}  # run id -> (key, step) already in its history when it resumed


def mark_replayed(uri: str | None, run_id: str | None, after_step: int) -> list[int]:
    """A resumed run replays the steps after its checkpoint, whose metrics the stopped run had logged already: record
    those (key, step) pairs so that :func:`log_metrics` (in this process) writes each step once -- MLflow cannot
    delete a metric point, so the history keeps the first run's values of a replayed step (the same rollouts, seeds
    and weights). Returns the replayed steps found."""
    if not run_id:
        return []
    c = client(uri)
    pairs = {(key, p.step) for key in c.get_run(run_id).data.metrics
             for p in c.get_metric_history(run_id, key) if p.step > after_step}
    _REPLAYED[run_id] = pairs
    return sorted({step for _, step in pairs})


def log_metrics(uri: str | None, run_id: str | None, metrics: Mapping[str, float], step: int) -> None:
    """Log finite numeric metrics at ``step`` (one batch request); after a resume, not those the stopped run logged
    at that step already (:func:`mark_replayed`)."""
    if not run_id:
        return
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    seen = _REPLAYED.get(run_id, ())
    items = [Metric(k, float(v), now, step) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
             and (k, step) not in seen]
    c = client(uri)
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i:i + 500])


def set_tags(uri: str | None, run_id: str | None, tags: Mapping[str, str]) -> None:
    """Set (or overwrite) run tags in one request; tags, unlike params, may change when a run resumes elsewhere."""
    if not run_id:
        return
    from mlflow.entities import RunTag

    client(uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_text(uri: str | None, run_id: str | None, text: str, path: str) -> None:
    if run_id:
        client(uri).log_text(run_id, text, path)


# the answer-first figure: (title, [(metric key, label)], with a 95% CI band from <key>_lo / _hi when logged)
CURVES = (("validation accuracy (95% CI)", "val/*/accuracy"),
          ("reward", (("reward/mean", "mean reward"),)),
          ("throughput (tokens/s)", (("throughput/rollout_tokens_per_s", "rollout"),
                                     ("throughput/train_tokens_per_s", "train"))),
          ("train / inference mismatch", (("mismatch/token_mult_prob_error", "token-mult-prob-error"),)),
          ("clip fractions", (("clip/lower_neg_adv_frac", "low bound, A < 0"),
                              ("clip/upper_pos_adv_frac", "high bound, A > 0"))),
          ("policy entropy", (("policy/entropy", "entropy (nats/token)"),)))


def plot_curves(uri: str | None, run_id: str | None, path: str = "curves.png") -> str | None:
    """One figure that answers "did accuracy and throughput hold up, at what mismatch?": validation accuracy of
    every set with its CI band, reward, rollout and train throughput, the mismatch, the clip fractions and the
    entropy over steps, logged as the run's ``path`` artifact (replaced at each call: the flow calls it at every
    checkpoint and at the end). Returns ``path``, or None without MLflow."""
    if not run_id:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = client(uri)
    keys = set(c.get_run(run_id).data.metrics)

    def hist(key):
        h = sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)
        return [m.step for m in h], [m.value for m in h]

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (title, series) in zip(axes.flat, CURVES, strict=True):
        if series == "val/*/accuracy":  # every validated set, from its per-set key
            sets = sorted(k.split("/")[1] for k in keys if k.startswith("val/") and k.endswith("/accuracy")
                          and k.count("/") == 2)
            series = tuple((f"val/{name}/accuracy", name) for name in sets)
        for key, label in series:
            if key not in keys:
                continue
            x, y = hist(key)
            ax.plot(x, y, marker="o", ms=3, label=label)
            if f"{key}_lo" in keys and f"{key}_hi" in keys:
                (xl, lo), (_, hi) = hist(f"{key}_lo"), hist(f"{key}_hi")
                ax.fill_between(xl, lo, hi, alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    c.log_figure(run_id, fig, path)
    plt.close(fig)
    return path


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(uri: str | None, run_id: str | None, *, status: str, summary: dict, plot: bool = True,
               report: str = "") -> str | None:
    """Final summary + the curves figure as artifacts, the run's description led by ``report`` (the flow's summary
    table: accuracy start -> end, mismatch, step time) above the where-to-look note; marks the run FINISHED/FAILED.
    Returns the plot path."""
    if not run_id:
        return None
    from mlflow.entities import RunTag

    c = client(uri)
    c.log_text(run_id, json.dumps(summary, indent=1, default=str), "summary.json")
    out = None
    try:
        if report:
            note = c.get_run(run_id).data.tags.get("mlflow.note.content", "")
            note = note.split("\n\n---\n\n", 1)[-1]  # a resumed run replaces the earlier report
            c.log_batch(run_id, tags=[RunTag("mlflow.note.content", f"{report}\n\n---\n\n{note}")])
        if plot:
            out = plot_curves(uri, run_id)
    finally:
        c.set_terminated(run_id, status=status)
    return out
