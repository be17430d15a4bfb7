"""Flow ``fp8-grpo-regression``: the nightly FP8-vs-BF16 regression.

    python -m flows.regression [key=value ...]          # overrides applied to both recipes
    prefect deployment run fp8-grpo-regression/nightly-regression   (scheduled nightly, see prefect.yaml)

Trains the BF16 recipe and the end-to-end FP8 recipe with the same seed and number of steps (checked before any
training starts) as two ``fp8-grpo`` subflows whose MLflow runs become child runs of one parent run; then logs to the
parent a comparison plot (validation accuracy, reward, token-mult-prob-error, throughput against step) and a verdict
(tasks/regression.py: accuracy drop, FP8 mismatch, FP8/BF16 throughput ratio, each against a threshold parameter;
the throughput floor is per CPU kind -- ``min_throughput_ratio`` None = tasks/regression.py ``MIN_THROUGHPUT_RATIO``,
a number = that floor on every kind, a ``{kind: floor}`` mapping = overrides -- and the verdict names the kind).
The flow run fails (``RegressionFailed``) when the verdict fails; the parent run is then marked FAILED with tag
``verdict=fail``.

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

from configs.schema import load_config  # noqa: E402


class RegressionFailed(RuntimeError):
    """The FP8 run regressed against BF16 beyond a threshold (the message lists the failed checks)."""


def _check_thresholds(max_accuracy_drop: float, max_token_mult_prob_error: float,
                      min_throughput_ratio: float | dict[str, float] | None):
    if not max_accuracy_drop >= 0:
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


def _same_seed_and_steps(bf16_recipe: str, fp8_recipe: str, overrides: list[str]):
    """Load both recipes (bad keys/types fail here with their dotted path) and require the same seed, steps and
    batch shape, so the comparison is like for like."""
    b, f = load_config(bf16_recipe, overrides), load_config(fp8_recipe, overrides)
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
               overrides: list[str] | None = None, max_accuracy_drop: float = 0.05,
               max_token_mult_prob_error: float = 1.10,
               min_throughput_ratio: float | dict[str, float] | None = None,
               experiment_name: str = "fp8-grpo-regression", tracking_uri: str | None = None,
               run_dir: str = "runs/regression") -> dict:
    from flows.grpo import grpo
    from fp8core.cpu import cpu_caps
    from tasks.regression import (
        comparison_plot,
        create_parent_run,
        link_child,
        log_verdict,
        throughput_threshold,
        verdict,
        verdict_markdown,
    )
    from tasks.tracking import client

    overrides = list(overrides or [])
    _check_thresholds(max_accuracy_drop, max_token_mult_prob_error, min_throughput_ratio)
    cfg_b, cfg_f = _same_seed_and_steps(bf16_recipe, fp8_recipe, overrides)
    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    name = f"regression-{stamp}"
    parent = create_parent_run(
        uri, experiment_name, name,
        params={"bf16_recipe": bf16_recipe, "fp8_recipe": fp8_recipe, "overrides": " ".join(overrides),
                "max_accuracy_drop": max_accuracy_drop, "max_token_mult_prob_error": max_token_mult_prob_error,
                "min_throughput_ratio": "per CPU kind (tasks/regression.py MIN_THROUGHPUT_RATIO)"
                if min_throughput_ratio is None else min_throughput_ratio,
                "cpu/driver_kind": cpu_caps().kind, "cpu/model": cpu_caps().model, "grpo.seed": cfg_b.grpo.seed,
                "grpo.max_num_steps": cfg_b.grpo.max_num_steps},
        tags={"kind": "regression", "bf16_recipe": cfg_b.recipe, "fp8_recipe": cfg_f.recipe,
              "precision": f"{cfg_b.precision_tag} vs {cfg_f.precision_tag}"})
    print(f"regression: parent MLflow run {parent} ({name}) at {uri}", flush=True)
    out_dir = root / f"{stamp}-{parent[:8]}"
    summaries, children, status = {}, {}, "FAILED"
    try:
        for role, recipe in (("bf16", bf16_recipe), ("fp8", fp8_recipe)):
            run_name = f"{name}-{role}"
            child_overrides = [*overrides, f"run_dir={out_dir / role}", "checkpointing.resume=false",
                               "logger.mlflow_enabled=true", f"logger.mlflow.experiment_name={experiment_name}",
                               f"logger.mlflow.tracking_uri={uri}", f"logger.mlflow.run_name={run_name}"]
            try:
                summaries[role] = grpo(recipe, child_overrides)
            finally:
                run_id = link_child(uri, parent, experiment_name, run_name, role)
                if run_id:
                    children[role] = run_id
        plot = comparison_plot(uri, parent, children, str(out_dir))
        kind = _cpu_kind(summaries)
        v = verdict(summaries["bf16"], summaries["fp8"], max_accuracy_drop=max_accuracy_drop,
                    max_token_mult_prob_error=max_token_mult_prob_error,
                    min_throughput_ratio=throughput_threshold(kind, min_throughput_ratio), cpu_kind=kind)
        md = verdict_markdown(v, parent_run_id=parent, children=children)
        (out_dir / "verdict.md").write_text(md)
        log_verdict(uri, parent, v, md, cfg_b.grpo.max_num_steps)
        print(md, flush=True)
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        regression(overrides=argv)
    except RegressionFailed as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
