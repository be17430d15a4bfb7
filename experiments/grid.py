"""The machinery every experiment shares: a grid of arms x seeds of ``fp8-grpo`` training runs as child MLflow runs of
one parent run, resumable, and the readers and statistics the experiments' tables are built from.

An **arm** is a recipe file plus overrides (``Arm("fp8-rollout-no-is", "configs/tiny_fp8_rollout.yaml",
("loss_fn.use_importance_sampling_correction=false",))``); its runs live in ``<out>/<arm>-seed<k>``. The experiment's
common overrides (``key=value`` applied to every run) come after the arm's, and ``grpo.seed`` = the seed after both.

One warm start for every seed (``Grid.warm_start_seed``, default ``WARM_START_SEED``): each run starts with
``bootstrap.sft_seed=<k>``, so the seeds of a grid differ in their RL only (sampling, prompt order), not in the
SFT model RL starts from -- with a warm start per seed, the BF16 reference's per-seed gains spread more than the arms
differ (docs/evaluation.md). ``warm_start_seed=None``, or ``bootstrap.sft_seed=null`` among the common overrides
(later overrides win), gives each RL seed its own warm start.

Resumable: after a run finishes, a marker (``<run dir>/<marker name>``: recipe, seed, the arm's + common overrides,
the MLflow run id) is written; a rerun skips every run whose marker matches and whose ``summary.json`` exists, and
reuses the parent run recorded in ``<out>/parent.json`` when the settings and store are the same. Runs go in
seed-major order: every arm of a seed, then the next seed (with a warm start per seed, right after it is built), so
an interrupted grid leaves complete seeds -- paired across arms -- rather than a complete arm.

Statistics (fp8core.stats): accuracies come from the per-prompt validation files of the runs (``val/main/step_*.jsonl``)
with a bootstrap over prompts, the seeds as strata (``seed_mean``), and arm-vs-reference differences are paired on the
same prompts and seeds (``paired_bootstrap``); per-step training metrics (mismatch, step time, clip fractions) get a
t interval over the per-seed means (``seed_t_interval``; none with one seed).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from configs.schema import load_config

WARM_START_SEED = 0  # the SFT warm start every seed of a grid shares (bootstrap.sft_seed), unless told otherwise

@dataclass(frozen=True)
class Arm:
    """One arm of a grid: ``name`` (its run directories' stem, unique in the grid), a recipe file and the overrides
    that make the arm (applied before the grid's common overrides); ``label`` is what tables and plots show."""

    name: str
    recipe: str
    overrides: tuple[str, ...] = ()
    label: str = ""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"Arm.name: a plain directory name is needed, got {self.name!r}")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if not self.label:
            object.__setattr__(self, "label", self.name)


@dataclass(frozen=True)
class Grid:
    """A grid of ``arms`` x ``seeds`` under ``root`` with ``common`` overrides; ``marker_name``: the per-run file that
    marks a finished run; ``kind``: the parent run's name prefix and tag (``<kind>.seed`` / ``<kind>.arm`` on the
    children); ``settings``: what identifies the grid in ``parent.json`` (default: arms, seeds, common overrides);
    ``warm_start_seed``: the ``bootstrap.sft_seed`` of every run (None: each seed its own warm start)."""

    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    root: Path
    common: tuple[str, ...] = ()
    kind: str = "grid"
    marker_name: str = "grid.json"
    note: str = ""
    settings: dict = field(default_factory=dict)
    warm_start_seed: int | None = WARM_START_SEED

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", tuple(self.arms))
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "common", tuple(self.common))
        object.__setattr__(self, "root", Path(self.root))
        if not self.arms or not self.seeds:
            raise ValueError(f"{self.kind}: needs at least one arm and one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: duplicates in {list(self.seeds)}")
        names = [a.name for a in self.arms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arms: duplicate names {dup}")

    def overrides(self, arm: Arm) -> list[str]:
        """The overrides of ``arm``'s runs (without the seed): the shared warm start's seed, the arm's, then the grid's
        common ones (a later override wins)."""
        shared = [] if self.warm_start_seed is None else [f"bootstrap.sft_seed={int(self.warm_start_seed)}"]
        return [*shared, *arm.overrides, *self.common]

    def marker(self, arm: Arm, seed: int) -> dict:
        return {"recipe": arm.recipe, "seed": int(seed), "overrides": self.overrides(arm)}

    def run_dir(self, arm: Arm, seed: int) -> Path:
        return self.root / f"{arm.name}-seed{seed}"

    def cells(self) -> list[tuple[Arm, int]]:
        """Seed-major: every arm of seed 0, then every arm of seed 1, ..."""
        return [(a, s) for s in self.seeds for a in self.arms]

    def finished(self, arm: Arm, seed: int) -> bool:
        return finished(self.run_dir(arm, seed), self.marker(arm, seed), self.marker_name)

    def done(self) -> set[tuple[str, int]]:
        """(arm name, seed) of the runs that finished with this grid's settings."""
        return {(a.name, s) for a, s in self.cells() if self.finished(a, s)}

    def run_id(self, arm: Arm, seed: int) -> str:
        return json.loads((self.run_dir(arm, seed) / self.marker_name).read_text())["mlflow_run_id"]

    def check_configs(self) -> dict[str, object]:
        """Load every arm's config with every seed (bad recipes / overrides fail here, naming the key, before any
        training, as does ``cluster.pin_cpus`` asking for more CPUs than this machine has); returns arm name -> the
        config of its first seed."""
        from cluster.runtime import cpu_pins

        out = {}
        for a in self.arms:
            for s in self.seeds:
                cfg = load_config(a.recipe, [*self.overrides(a), f"grpo.seed={s}"])
                cpu_pins(cfg)
                out.setdefault(a.name, cfg)
        return out


def finished(run_dir: Path, marker: dict, marker_name: str) -> bool:
    """True when ``run_dir`` holds a run that completed with exactly this recipe, seed and overrides."""
    f = run_dir / marker_name
    if not f.exists():
        return False
    try:
        done = json.loads(f.read_text())
    except json.JSONDecodeError:
        return False
    return {k: done.get(k) for k in marker} == marker and (run_dir / "summary.json").exists()


def resolve_tracking_uri(root: Path, uri: str | None) -> str:
    """``uri``, else $MLFLOW_TRACKING_URI, else ``<root>/mlflow.db``."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def parent_run(uri: str, root: Path, experiment: str, settings: dict, *, kind: str, note: str) -> tuple[str, str]:
    """(run id, name) of the parent MLflow run of this experiment directory: reused when ``parent.json`` records the
    same settings and store (a resumed experiment), else a new one."""
    from mlflow.entities import Param, RunTag

    from tasks.tracking import client, experiment_id

    f = root / "parent.json"
    if f.exists():
        old = json.loads(f.read_text())
        if old.get("settings") == settings and old.get("tracking_uri") == uri:
            return old["run_id"], old["name"]
    c = client(uri)
    exp_id = experiment_id(c, experiment)
    name = f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    run_id = c.create_run(exp_id, run_name=name, tags={"kind": kind}).info.run_id
    c.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(settings.items())],
                tags=[RunTag("mlflow.note.content", note)] if note else [])
    f.write_text(json.dumps({"run_id": run_id, "name": name, "settings": settings, "tracking_uri": uri}, indent=1))
    return run_id, name


def run_grid(grid: Grid, *, experiment: str, tracking_uri: str | None = None, train: bool = True,
             report: Callable[[Grid, str, str], dict] | None = None) -> dict:
    """Train the missing runs of ``grid`` (each one ``flows.grpo.grpo`` call, a child MLflow run of the parent), then
    ``report(grid, uri, parent_run_id)`` (the experiment's tables and plots; it logs to the parent what it wants).
    Call it inside the experiment's Prefect flow. Returns ``{"parent_run_id", "out_dir", "done", **report(...)}``;
    the parent ends FINISHED, or FAILED when a run or the report raised."""
    from flows.grpo import grpo
    from tasks.tracking import client
    from tools.results import invocation

    grid.check_configs()
    trained_by = invocation()  # this invocation's commit, date, CPU and command, kept with each run it trains
    root = grid.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = resolve_tracking_uri(root, tracking_uri)
    settings = grid.settings or {"arms": [[a.name, a.recipe, list(a.overrides)] for a in grid.arms],
                                 "seeds": list(grid.seeds), "overrides": list(grid.common)}
    parent, parent_name = parent_run(uri, root, experiment, settings, kind=grid.kind, note=grid.note)
    print(f"{grid.kind}: parent MLflow run {parent} ({parent_name}) at {uri}; {len(grid.arms)} arms x "
          f"{len(grid.seeds)} seeds", flush=True)
    status = "FAILED"
    try:
        for arm, seed in grid.cells():
            if not train:
                break
            run_dir = grid.run_dir(arm, seed)
            if grid.finished(arm, seed):
                print(f"{grid.kind}: {run_dir.name} already finished, skipped", flush=True)
                continue
            name = f"{parent_name}-{arm.name}-seed{seed}"
            child = [*grid.overrides(arm), f"grpo.seed={seed}", f"run_dir={run_dir}", "checkpointing.resume=false",
                     "logger.mlflow_enabled=true", f"logger.mlflow.experiment_name={experiment}",
                     f"logger.mlflow.tracking_uri={uri}", f"logger.mlflow.run_name={name}"]
            print(f"{grid.kind}: training {run_dir.name}", flush=True)
            summary = grpo(arm.recipe, child)
            c = client(uri)
            c.set_tag(summary["mlflow_run_id"], "mlflow.parentRunId", parent)
            c.set_tag(summary["mlflow_run_id"], f"{grid.kind}.seed", str(seed))
            c.set_tag(summary["mlflow_run_id"], f"{grid.kind}.arm", arm.name)
            (run_dir / grid.marker_name).write_text(json.dumps({**grid.marker(arm, seed),
                                                                "mlflow_run_id": summary["mlflow_run_id"],
                                                                "trained_by": trained_by}))
        out = report(grid, uri, parent) if report else {}
        status = "FINISHED"
    finally:
        client(uri).set_terminated(parent, status=status)
    return {"parent_run_id": parent, "out_dir": str(root), "done": sorted(grid.done()),
            "provenance": provenance(grid), **out}


def provenance(grid: Grid) -> list[str]:
    """One ``- ...`` line per invocation that trained the grid's finished runs (commit, date, CPU and command, from
    each run's marker), naming its runs: a results file written by a resumed grid states where every run came from,
    not only its last invocation. Runs trained before markers carried this say so."""
    from tools.results import commit_text

    groups: dict[str, list[str]] = {}
    for arm, seed in grid.cells():
        if not grid.finished(arm, seed):
            continue
        tb = json.loads((grid.run_dir(arm, seed) / grid.marker_name).read_text()).get("trained_by")
        if tb:
            key = (f"- runs trained at commit {commit_text(tb)}, {tb['date']}, CPU {tb['cpu_model']} (kind "
                   f"`{tb['cpu_kind']}`), by `{tb['command']}`")
        else:
            key = "- runs trained before grid runs recorded their origin (commit, date and CPU not recorded)"
        groups.setdefault(key, []).append(f"{arm.name} seed {seed}")
    return [f"{key}: {', '.join(runs)}" for key, runs in groups.items()]



def log_report(uri: str, parent: str, root: Path, texts: dict[str, str], figures: Iterable[Path] = ()) -> None:
    """Write ``texts`` (file name -> content) under ``root`` and log them and the PNG ``figures`` to the parent run."""
    from tasks.tracking import client

    c = client(uri)
    for name, text in texts.items():
        (root / name).write_text(text)
        c.log_text(parent, text, name)
    for f in figures:
        c.log_artifact(parent, str(f), "plots")


# -- reading finished runs ---------------------------------------------------------------------------------------------


def history(c, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of one metric of one run."""
    return {m.step: m.value for m in c.get_metric_history(run_id, key)}


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def val_files(run_dir: Path) -> dict[int, str]:
    """{step: per-prompt validation file} of the main validation set (summary.json ``val_files``)."""
    files = json.loads((Path(run_dir) / "summary.json").read_text()).get("val_files", {}).get("main") or {}
    return {int(k): v for k, v in files.items()}


def val_correct(run_dir: Path, step: int) -> dict:
    """Per-prompt 0/1 correctness of the main validation set at ``step`` (run_dir/val/main/step_*.jsonl, named in
    summary.json, written by tasks/rl.py validate)."""
    files = val_files(run_dir)
    if step not in files:
        raise FileNotFoundError(f"{run_dir}: no per-prompt validation file of step {step} in summary.json val_files")
    return {r["id"]: 1.0 if r["correct"] else 0.0 for r in map(json.loads, Path(files[step]).read_text().splitlines())}


def aligned(rows: Sequence[dict]) -> tuple[list, list[list[float]]]:
    """The prompt ids every dict of ``rows`` (id -> value) has, and each row's values on them (same order)."""
    ids = sorted(set.intersection(*(set(r) for r in rows)), key=str)
    return ids, [[r[i] for i in ids] for r in rows]


# -- statistics over seeds ---------------------------------------------------------------------------------------------


def seed_mean(per_seed: Sequence[Sequence[float]], *, n_boot: int = 2000) -> dict:
    """Mean over seeds of the mean over prompts, with a bootstrap CI over prompts, seeds as strata (the same prompt
    indices in every stratum: fp8core.stats.paired_bootstrap against zero)."""
    from fp8core.stats import paired_bootstrap

    zeros = [[0.0] * len(r) for r in per_seed]
    return paired_bootstrap(zeros, per_seed, n_boot=n_boot, shared_prompts=len({len(r) for r in per_seed}) == 1
                            ).as_dict()


def paired_diff(ref: Sequence[Sequence[float]], arm: Sequence[Sequence[float]], *, n_boot: int = 2000) -> dict:
    """``arm - ref`` on the same prompts and seeds, paired bootstrap with seeds as strata."""
    from fp8core.stats import paired_bootstrap

    return paired_bootstrap(ref, arm, n_boot=n_boot, shared_prompts=len({len(r) for r in ref}) == 1).as_dict()


def seed_t_interval(values: Sequence[float], *, confidence: float = 0.95) -> dict:
    """Mean of per-seed values with a Student-t interval over seeds ({"value", "lo", "hi", "n"}; lo/hi are nan with
    fewer than two seeds: one seed says nothing about seed-to-seed spread)."""
    from scipy.stats import t

    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(xs)
    if n == 0:
        return {"value": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    m = sum(xs) / n
    if n < 2:
        return {"value": m, "lo": float("nan"), "hi": float("nan"), "n": 1}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"value": m, "lo": m - half, "hi": m + half, "n": n}


def fmt_ci(e: dict, *, scale: float = 1.0, digits: int = 3, signed: bool = False) -> str:
    """``0.812 [0.790, 0.834]`` (or ``0.812`` when the interval is undefined)."""
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    v = f.format(scale * e["value"])
    if math.isnan(e.get("lo", float("nan"))):
        return v
    return f"{v} [{f.format(scale * e['lo'])}, {f.format(scale * e['hi'])}]"


# -- plots -------------------------------------------------------------------------------------------------------------


def plot_curves(path: Path, title: str, panels: Sequence[tuple], ) -> Path:
    """One PNG with a panel per ``(y label, {arm label: {step: (mean, lo, hi)}}[, {"yscale": "log"}])``; a band where
    lo/hi are finite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for panel in panels for label in panel[1]))
    cmap = plt.get_cmap("tab10")
    color = {label: cmap(i % 10) for i, label in enumerate(labels)}  # an arm keeps its colour in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (ylabel, series, *opts) in zip(axes[0], panels, strict=True):
        if opts and opts[0].get("yscale"):
            ax.set_yscale(opts[0]["yscale"])
        for label, pts in series.items():
            steps = sorted(pts)
            if not steps:
                continue
            ys = [pts[s][0] for s in steps]
            ax.plot(steps, ys, marker="o" if len(steps) < 12 else None, ms=3, label=label, color=color[label])
            lo = [pts[s][1] for s in steps]
            hi = [pts[s][2] for s in steps]
            if all(math.isfinite(x) for x in lo + hi):
                ax.fill_between(steps, lo, hi, alpha=0.15, color=color[label])
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=color[label], label=label) for label in labels]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(labels), 4), fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(labels) - 1) // 4), 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the finished runs of an arm, and the figures tables are made of ---------------------------------------------------


@dataclass
class ArmRuns:
    """The finished runs of one arm: ``seeds`` (in grid order), their MLflow ``run_ids`` and ``summaries``,
    ``hist[key][i]`` = {step: value} of seed i, ``val[step][i]`` = {prompt id: 0/1} of seed i at every validation
    step all its seeds have."""

    arm: Arm
    seeds: list[int]
    run_ids: list[str]
    summaries: list[dict]
    hist: dict[str, list[dict[int, float]]]
    val: dict[int, list[dict]]

    @property
    def last_val_step(self) -> int:
        return max(self.val)


def collect(grid: Grid, uri: str, keys: Sequence[str]) -> tuple[list[ArmRuns], list[str]]:
    """ArmRuns of every arm with at least one finished seed (grid order), and ``"<arm> seed <k>"`` of the runs that
    have not finished (named under the tables)."""
    from tasks.tracking import client

    c = client(uri)
    done = grid.done()
    out, missing = [], []
    for arm in grid.arms:
        seeds = [s for s in grid.seeds if (arm.name, s) in done]
        missing += [f"{arm.name} seed {s}" for s in grid.seeds if s not in seeds]
        if not seeds:
            continue
        run_ids = [grid.run_id(arm, s) for s in seeds]
        dirs = [grid.run_dir(arm, s) for s in seeds]
        summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
        steps = sorted(set.intersection(*(set(val_files(d)) for d in dirs)))
        val = {st: [val_correct(d, st) for d in dirs] for st in steps}
        hist = {k: [history(c, r, k) for r in run_ids] for k in keys}
        out.append(ArmRuns(arm, seeds, run_ids, summaries, hist, val))
    return out, missing


def accuracy_curve(a: ArmRuns, *, n_boot: int = 2000) -> dict[int, dict]:
    """{validation step: seed_mean of per-prompt correctness} (prompts every seed has at that step)."""
    return {st: seed_mean(aligned(rows)[1], n_boot=n_boot) for st, rows in sorted(a.val.items())}


def accuracy_vs(ref: ArmRuns, a: ArmRuns, *, n_boot: int = 2000) -> dict | None:
    """``a - ref`` in accuracy at each arm's last validation, paired on the prompts and seeds both have (None when
    they share no seed)."""
    seeds = [s for s in a.seeds if s in ref.seeds]
    if not seeds:
        return None
    ra = ref.val[ref.last_val_step]
    aa = a.val[a.last_val_step]
    pairs = [(ra[ref.seeds.index(s)], aa[a.seeds.index(s)]) for s in seeds]
    x, y = [], []
    for r_, a_ in pairs:
        _, (xr, ya) = aligned([r_, a_])
        x.append(xr)
        y.append(ya)
    per_seed = [mean(ya) - mean(xr) for xr, ya in zip(x, y, strict=True)]
    return {**paired_diff(x, y, n_boot=n_boot), "seeds": seeds, "per_seed": per_seed,
            "over_seeds": seed_t_interval(per_seed)}


def fmt_vs(e: dict | None, *, scale: float = 100.0, digits: int = 1) -> str:
    """A comparison of arms as the tables state it: the difference with its prompt-bootstrap interval, the per-seed
    differences and the Student-t interval over seeds of those paired differences. Bold and a difference claimed only
    when the interval over seeds excludes 0; otherwise "no difference shown" (one seed: no interval over seeds)."""
    if e is None:
        return "n/a"
    f = f"{{:+.{digits}f}}"
    seeds = " / ".join(f.format(scale * d) for d in e.get("per_seed", []))
    o = e.get("over_seeds") or {"lo": math.nan, "n": 0}
    if o["n"] < 2 or math.isnan(o["lo"]):
        return f"{fmt_ci(e, scale=scale, digits=digits, signed=True)}; per seed {seeds}; one seed, no interval over seeds"
    text = (f"{fmt_ci(e, scale=scale, digits=digits, signed=True)}; per seed {seeds}; over seeds "
            f"[{f.format(scale * o['lo'])}, {f.format(scale * o['hi'])}]")
    return f"**{text}**" if o["lo"] > 0 or o["hi"] < 0 else f"{text}, no difference shown"


VS_HEADER = "points: prompt bootstrap [95% CI]; per seed; over seeds [95% t CI]"


def metric_summary(a: ArmRuns, key: str, *, reduce: Callable[[Sequence[float]], float] = mean) -> dict:
    """t interval over seeds of each seed's ``reduce`` (default: mean over steps) of metric ``key``."""
    return seed_t_interval([reduce(list(h.values())) if h else float("nan") for h in a.hist[key]])


def metric_curve(a: ArmRuns, key: str, *, band: str = "t", shift: float = 0.0) -> dict[int, tuple[float, float, float]]:
    """{step: (mean over seeds, lo, hi)} of metric ``key`` minus ``shift``, at the steps every seed logged. ``band``:
    ``"t"`` a 95% t interval over seeds, ``"range"`` the seeds' min and max (a figure's band: with 2-3 seeds a t
    interval is 4-13 standard errors wide); nan bounds with one seed."""
    if band not in ("t", "range"):
        raise ValueError(f"band must be 't' or 'range', got {band!r}")
    steps = sorted(set.intersection(*(set(h) for h in a.hist[key]))) if a.hist[key] else []
    out = {}
    for st in steps:
        vals = [h[st] - shift for h in a.hist[key]]
        if band == "t":
            e = seed_t_interval(vals)
            out[st] = (e["value"], e["lo"], e["hi"])
        else:
            lo, hi = (min(vals), max(vals)) if len(vals) > 1 else (math.nan, math.nan)
            out[st] = (sum(vals) / len(vals), lo, hi)
    return out


def as_points(curve: dict[int, dict]) -> dict[int, tuple[float, float, float]]:
    return {st: (e["value"], e["lo"], e["hi"]) for st, e in curve.items()}


def parse_ints(text: str, what: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]; a ValueError naming ``what`` otherwise."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{what}: comma-separated integers expected, got {text!r}") from None
