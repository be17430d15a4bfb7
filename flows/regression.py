"""Flow ``fp8-grpo-regression``: the nightly FP8-vs-BF16 regression.

    python -m flows.regression [--seeds=0,1,2] [--fp8=key=value ...] [--max-accuracy-drop=X] [--run-dir=D]
                               [key=value ...]   # overrides applied to both recipes; --fp8=...: the FP8 runs only
    prefect deployment run fp8-grpo-regression/nightly-regression   (scheduled nightly, see prefect.yaml)

Trains the BF16 recipe and the end-to-end FP8 recipe with the same seeds and number of steps (checked before any
training starts): for each seed in ``seeds`` (default: tasks/regression.py ``DEFAULT_SEEDS``, the number the power
calculation needs) one ``fp8-grpo`` subflow per recipe, whose MLflow runs become child runs of one parent run; then
logs to the parent a comparison plot (validation accuracy, reward, token-mult-prob-error, throughput against step)
and a verdict (tasks/regression.py: the paired accuracy drop over prompts x seeds x validation steps, against a
threshold sized so that a real 5-point drop fails with >= 80% power; FP8 mismatch; FP8/BF16 throughput ratio;
the throughput floor is per CPU kind -- ``min_throughput_ratio`` None = tasks/regression.py ``MIN_THROUGHPUT_RATIO``,
a number = that floor on every kind, a ``{kind: floor}`` mapping = overrides -- and the verdict names the kind).
The flow run fails (``RegressionFailed``) when the verdict fails; the parent run is then marked FAILED with tag
``verdict=fail``. ``fp8_overrides`` apply to the FP8 runs only (the tests degrade them with the TEST-ONLY
``testing.fault_val_accuracy_drop``). The children validate the main set only (``CHILD_EVAL`` turns the extra
evaluation sets and sampled pass@k off: the verdict does not read them; overrides can turn them back on).

Tracking store: ``tracking_uri`` parameter, else $MLFLOW_TRACKING_URI (the stack's MLflow server), else a sqlite file
under ``run_dir``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # as flows/grpo.py: Prefect reads its home at import, keep it under runs/
    _home = Path("runs/.prefect").resolve()
    os.environ.setdefault("PREFECT_HOME", str(_home))
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(_home / "memo_store.toml"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    _home.mkdir(parents=True, exist_ok=True)

from prefect import flow  # noqa: E402

import process.quiet  # noqa: E402,F401  third-party start-up noise off (process/quiet.py)
from configs.schema import load_config  # noqa: E402


class RegressionFailed(RuntimeError):
    """The FP8 run regressed against BF16 beyond a threshold (the message lists the failed checks)."""


CHILD_EVAL = ["evaluation.num_samples=0", "evaluation.sets=[]"]


def _check_thresholds(max_accuracy_drop: float | None, max_token_mult_prob_error: float,
                      min_throughput_ratio: float | dict[str, float] | None, seeds: list[int] | None = None):
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"seeds: need one or more distinct seeds, got {seeds}")
    if max_accuracy_drop is not None and not max_accuracy_drop >= 0:
        raise ValueError(f"max_accuracy_drop: must be >= 0 (an accuracy difference), got {max_accuracy_drop}")
    if not max_token_mult_prob_error >= 1.0:
        raise ValueError("max_token_mult_prob_error: mean exp(|logp_train - logp_rollout|) is >= 1, so a threshold "
                         f"below 1 can never pass; got {max_token_mult_prob_error}")
    ratios = min_throughput_ratio.values() if isinstance(min_throughput_ratio, dict) else \
        ([] if min_throughput_ratio is None else [min_throughput_ratio])
    if not all(isinstance(r, (int, float)) and r > 0 for r in ratios):
        raise ValueError(f"min_throughput_ratio: must be > 0 (a number, or {{cpu kind: number}}), "
                         f"got {min_throughput_ratio}")
    if isinstance(min_throughput_ratio, dict):
        from fp8core.cpu import KINDS

        unknown = sorted(set(min_throughput_ratio) - set(KINDS) - {"gpu"})
        if unknown:
            raise ValueError(f"min_throughput_ratio: unknown CPU kinds {unknown} (kinds: {', '.join(KINDS)}, gpu)")


def _cpu_kind(summaries: dict) -> str:
    """The kind the FP8 run trained on (its trainer's node); says so when the two runs saw different kinds."""
    kinds = {role: s.get("cpu_kind", "unknown") for role, s in summaries.items()}
    fp8 = kinds.get("fp8", "unknown")
    if len(set(kinds.values())) > 1:
        print(f"regression: the runs trained on different CPU kinds {kinds}; the floor of {fp8} applies", flush=True)
    return fp8


def _same_seed_and_steps(bf16_recipe: str, fp8_recipe: str, overrides: list[str],
                         fp8_overrides: list[str] | None = None):
    """Load both recipes (bad keys/types fail here with their dotted path) and require the same seed, steps and
    batch shape, so the comparison is like for like."""
    b, f = load_config(bf16_recipe, overrides), load_config(fp8_recipe, [*overrides, *(fp8_overrides or [])])
    for key in ("seed", "max_num_steps", "num_prompts_per_step", "num_generations_per_prompt"):
        vb, vf = getattr(b.grpo, key), getattr(f.grpo, key)
        if vb != vf:
            raise ValueError(f"grpo.{key}: the regression compares like for like, but {bf16_recipe} has {vb} and "
                             f"{fp8_recipe} has {vf}; make them equal (e.g. an override grpo.{key}=...)")
    if f.precision_tag == b.precision_tag:
        raise ValueError(f"fp8_recipe: {fp8_recipe} has the same precision ({f.precision_tag}) as {bf16_recipe}")
    return b, f


@flow(name="fp8-grpo-regression", log_prints=False, validate_parameters=True)
def regression(bf16_recipe: str = "configs/tiny_bf16.yaml", fp8_recipe: str = "configs/tiny_fp8_e2e.yaml",
               overrides: list[str] | None = None, max_accuracy_drop: float | None = None,
               max_token_mult_prob_error: float = 1.10,
               min_throughput_ratio: float | dict[str, float] | None = None,
               experiment_name: str = "fp8-grpo-regression", tracking_uri: str | None = None,
               run_dir: str = "runs/regression", seeds: list[int] | None = None,
               fp8_overrides: list[str] | None = None) -> dict:
    from fp8core.cpu import cpu_caps
    from tasks.regression import DEFAULT_SEEDS, comparison_plot, create_parent_run
    from tasks.tracking import client

    overrides, fp8_overrides = list(overrides or []), list(fp8_overrides or [])
    seeds = list(range(DEFAULT_SEEDS)) if seeds is None else [int(s) for s in seeds]
    _check_thresholds(max_accuracy_drop, max_token_mult_prob_error, min_throughput_ratio, seeds)
    cfg_b, cfg_f = _same_seed_and_steps(bf16_recipe, fp8_recipe, overrides, fp8_overrides)
    plan = _accuracy_plan(len(seeds), max_accuracy_drop)
    max_accuracy_drop = plan["threshold"]  # the powered default, or the caller's
    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    name = f"regression-{stamp}"
    parent = create_parent_run(
        uri, experiment_name, name,
        params={"bf16_recipe": bf16_recipe, "fp8_recipe": fp8_recipe, "overrides": " ".join(overrides),
                "fp8_overrides": " ".join(fp8_overrides), "seeds": ",".join(map(str, seeds)),
                "power_at_5_points": round(plan["power"], 4), "false_fail_rate": round(plan["false_fail"], 4),
                "max_accuracy_drop": max_accuracy_drop, "max_token_mult_prob_error": max_token_mult_prob_error,
                "min_throughput_ratio": "per CPU kind (tasks/regression.py MIN_THROUGHPUT_RATIO)"
                if min_throughput_ratio is None else min_throughput_ratio,
                "cpu/driver_kind": cpu_caps().kind, "cpu/model": cpu_caps().model, "grpo.seed": cfg_b.grpo.seed,
                "grpo.max_num_steps": cfg_b.grpo.max_num_steps},
        tags={"kind": "regression", "bf16_recipe": cfg_b.recipe, "fp8_recipe": cfg_f.recipe,
              "precision": f"{cfg_b.precision_tag} vs {cfg_f.precision_tag}"})
    _say_parent_and_plan(uri, parent, name, seeds, max_accuracy_drop, plan)
    out_dir = root / f"{stamp}-{parent[:8]}"
    status = "FAILED"
    try:
        runs, children = _train_children(uri=uri, parent=parent, name=name, experiment_name=experiment_name,
                                         out_dir=out_dir, seeds=seeds, bf16_recipe=bf16_recipe,
                                         fp8_recipe=fp8_recipe, overrides=overrides, fp8_overrides=fp8_overrides)
        plot = comparison_plot(uri, parent, children, str(out_dir))
        v = _verdict(uri=uri, parent=parent, children=children, runs=runs, out_dir=out_dir, plan=plan,
                     max_accuracy_drop=max_accuracy_drop, max_token_mult_prob_error=max_token_mult_prob_error,
                     min_throughput_ratio=min_throughput_ratio, steps=cfg_b.grpo.max_num_steps)
        status = "FINISHED" if v["passed"] else "FAILED"
    finally:
        client(uri).set_terminated(parent, status=status)
    result = {"passed": v["passed"], "verdict": v, "parent_run_id": parent, "child_run_ids": children,
              "plot": plot, "tracking_uri": uri, "out_dir": str(out_dir)}
    if not v["passed"]:
        failed = ", ".join(f"{c['name']}={c['value']} (threshold {c['threshold']})" for c in v["checks"]
                           if not c["passed"])
        raise RegressionFailed(f"FP8 vs BF16 regression failed: {failed}; MLflow parent run {parent} at {uri}")
    return result


def _accuracy_plan(num_seeds: int, max_accuracy_drop: float | None) -> dict:
    """The accuracy check's plan for ``num_seeds`` seed pairs (tasks/regression.py accuracy_plan) with its powered
    threshold, or with the caller's ``max_accuracy_drop`` as the threshold and that threshold's power and
    false-fail rate under the same noise model."""
    from tasks.regression import accuracy_plan

    plan = accuracy_plan(num_seeds)
    if max_accuracy_drop is not None:  # a caller's threshold: report its power and false-fail rate
        from statistics import NormalDist

        nd, se = NormalDist(), plan["se"]
        plan.update(threshold=max_accuracy_drop, power=1 - nd.cdf((max_accuracy_drop - plan["effect"]) / se),
                    false_fail=1 - nd.cdf(max_accuracy_drop / se))
    return plan


def _say_parent_and_plan(uri: str, parent: str, name: str, seeds: list[int], max_accuracy_drop: float,
                         plan: dict) -> None:
    """Print where the parent MLflow run is and what the accuracy check can tell with these seeds."""
    from tasks.tracking import client, ui_url

    exp_id = client(uri).get_run(parent).info.experiment_id
    print(f"regression: parent MLflow run {parent} ({name}) at {uri}: {ui_url(uri, exp_id, parent)}", flush=True)
    print(f"regression: {len(seeds)} seeds {seeds}: fail when the paired accuracy drop BF16 - FP8 exceeds "
          f"{max_accuracy_drop:.4f}; a real {plan['effect']:.2f} drop fails with probability {plan['power']:.0%}, a "
          f"correct FP8 run fails {plan['false_fail']:.1%} of the time (noise SD per seed "
          f"{plan['noise_sd_per_seed']}, tasks/regression.py)", flush=True)


def _train_children(*, uri: str, parent: str, name: str, experiment_name: str, out_dir: Path, seeds: list[int],
                    bf16_recipe: str, fp8_recipe: str, overrides: list[str],
                    fp8_overrides: list[str]) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """For each seed, one ``fp8-grpo`` subflow per recipe (BF16, then FP8), each run linked to the parent as a child
    run (also when it fails). Returns the runs' summaries by role and the child run ids by tag."""
    from flows.grpo import grpo
    from tasks.regression import link_child

    runs: dict[str, list[dict]] = {"bf16": [], "fp8": []}
    children: dict[str, str] = {}
    for seed in seeds:
        for role, recipe in (("bf16", bf16_recipe), ("fp8", fp8_recipe)):
            tag = role if len(seeds) == 1 else f"{role}-s{seed}"
            run_name = f"{name}-{tag}"
            child_overrides = [*CHILD_EVAL, *overrides, *(fp8_overrides if role == "fp8" else []),
                               f"grpo.seed={seed}", f"run_dir={out_dir / tag}", "checkpointing.resume=false",
                               "logger.mlflow_enabled=true", f"logger.mlflow.experiment_name={experiment_name}",
                               f"logger.mlflow.tracking_uri={uri}", f"logger.mlflow.run_name={run_name}"]
            try:
                runs[role].append(grpo(recipe, child_overrides))
            finally:
                run_id = link_child(uri, parent, experiment_name, run_name, role, seed)
                if run_id:
                    children[tag] = run_id
    return runs, children


def _verdict(*, uri: str, parent: str, children: dict[str, str], runs: dict[str, list[dict]], out_dir: Path,
             plan: dict, max_accuracy_drop: float, max_token_mult_prob_error: float,
             min_throughput_ratio: float | dict[str, float] | None, steps: int) -> dict:
    """The verdict on the seed-averaged summaries and the paired accuracy drop (the throughput floor of the CPU kind
    the FP8 run trained on), written to out_dir/verdict.md, logged to the parent run and printed."""
    from tasks.regression import log_verdict, paired_drop, throughput_threshold, verdict, verdict_markdown

    summaries = {role: _mean_summary(rs) for role, rs in runs.items()}
    kind = _cpu_kind(summaries)
    paired = paired_drop(runs["bf16"], runs["fp8"])
    v = verdict(summaries["bf16"], summaries["fp8"], max_accuracy_drop=max_accuracy_drop,
                max_token_mult_prob_error=max_token_mult_prob_error,
                min_throughput_ratio=throughput_threshold(kind, min_throughput_ratio), cpu_kind=kind,
                paired=paired, plan=plan)
    md = verdict_markdown(v, parent_run_id=parent, children=children)
    (out_dir / "verdict.md").write_text(md)
    log_verdict(uri, parent, v, md, steps)
    print(md, flush=True)
    return v


def _mean_summary(runs: list[dict]) -> dict:
    """The runs' summaries averaged key by key over seeds (numbers only; the first run's CPU kind)."""
    out: dict = {"cpu_kind": runs[0].get("cpu_kind", "unknown") if runs else "unknown"}
    for key in ("val_accuracy_end", "mean_token_mult_prob_error", "mean_step_s", "mean_rollout_tokens_per_s",
                "mean_train_tokens_per_s"):
        vals = [r.get(key) for r in runs]
        ok = [float(x) for x in vals if isinstance(x, (int, float)) and not isinstance(x, bool)]
        out[key] = sum(ok) / len(ok) if ok and len(ok) == len(vals) else None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    kw: dict = {}
    fp8_overrides = []
    for a in [a for a in argv if a.startswith("--")]:
        name, _, value = a[2:].partition("=")
        if name == "seeds":  # --seeds=0,1,2 (default: DEFAULT_SEEDS)
            kw["seeds"] = [int(x) for x in value.split(",") if x]
        elif name == "fp8":  # --fp8=key=value: an override for the FP8 runs only
            fp8_overrides.append(value)
        elif name in ("max-accuracy-drop", "min-throughput-ratio", "max-token-mult-prob-error"):
            kw[name.replace("-", "_")] = float(value)
        elif name == "run-dir":
            kw["run_dir"] = value
        else:
            print(f"unknown option {a} (--seeds=, --fp8=key=value, --max-accuracy-drop=, --min-throughput-ratio=, "
                  "--max-token-mult-prob-error=, --run-dir=)", file=sys.stderr)
            return 2
        argv.remove(a)
    try:
        regression(overrides=argv, fp8_overrides=fp8_overrides, **kw)
    except RegressionFailed as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
