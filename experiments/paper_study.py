"""Experiment ``fp8-grpo-paper-study``: the study of "Towards Full Pipeline FP8 RL" on the embedded workload -- BF16 vs
vanilla end-to-end FP8 vs FP8 + Calibrated Clipping for the blockwise, rowwise and tensorwise recipes, the
ratio-error amplification at every calibration, and an ablation of the calibration interval with the shadow pass's
wall-clock cost.

    python -m experiments.paper_study [--seeds 0,1,2] [--fp8-recipes blockwise,rowwise,tensorwise]
                                      [--clip-period 5] [--intervals 1,2,5] [--ablation-recipe blockwise]
                                      [--arms bf16,fp8-blockwise,...] [--out runs/paper_study] [--table-only]
                                      [key=value ...]

Arms (each a recipe + overrides; one ``fp8-grpo`` run per arm x seed, child MLflow runs of one parent, resumable:
experiments/grid.py):

- ``bf16``: configs/tiny_bf16.yaml;
- ``fp8-<r>``: configs/tiny_fp8_e2e.yaml with ``policy.megatron_cfg.fp8_cfg.fp8_recipe=<r>`` (the rollout follows
  the trainer's recipe), fixed BF16 clip bounds;
- ``fp8-<r>-cc``: the same + ``calibration.calibrated_clipping=true calibration.clip_period=<K>`` (``--clip-period``);
- interval ablation ``fp8-<ablation recipe>-cc-k<K>`` for each K of ``--intervals`` (the main CC arm stands for its
  own K). Every Calibrated-Clipping run must calibrate at least 3 times (``grpo.max_num_steps // K >= 3``), else the
  command fails before training, naming the interval.

``--old-logprobs rollout`` makes pi_old of every arm's ratio the rollout engine's logprob (``loss_fn.old_logprobs=rollout``,
no separate IS weight), so the ratio carries the train/inference mismatch; ``--fp8-kv-cache`` runs the FP8 arms with
the FP8 KV cache (configs/tiny_fp8_e2e_kv.yaml). Together: the full pipeline in the regime where FP8 noise enters the
ratio.

Tables (``<out>/paper_study.md``, logged to the parent with the PNG plots under ``<out>/plots``): per arm the
validation accuracy at the last validation and its difference to BF16 (paired on prompts and seeds), the mean of
``clip/lower_neg_adv_frac`` (negative-advantage tokens silenced at the lower bound: the paper's failure signal, pooled
over the updates after the first of each step), ``policy/entropy`` first -> last step, the mean
``calib/ratio_error_amplification`` over the calibrations (mean |r_fp8 - r_bf16| / mean |p_fp8 - p_bf16|,
fp8core/rl/calibrated_clipping.py) and the bounds after the last calibration; per interval K the number of
calibrations, the shadow pass's time per calibration (``time/clip_calibration_s``) and its share of the step time and
of the run's wall time. Means over seeds with a 95% t interval over seeds (none with one seed); accuracies with a
bootstrap over prompts, seeds as strata.

When it finishes, ``main`` writes the tables and figures, stamped (commit, date, CPU, command line: tools.results), to
docs/results/paper_study.md (``--results-doc PATH``; ``--no-results-doc`` for none) and copies the PNGs to docs/img/.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # as flows/grpo.py: Prefect reads its home at import, keep it under runs/
    from flows.cli_env import prefect_cli_env

    prefect_cli_env()

from prefect import flow  # noqa: E402

import process.quiet  # noqa: E402,F401  third-party start-up noise off (process/quiet.py)
from experiments.grid import (  # noqa: E402
    VS_HEADER,
    Arm,
    ArmRuns,
    Grid,
    accuracy_curve,
    accuracy_vs,
    as_points,
    collect,
    fmt_ci,
    fmt_vs,
    log_report,
    mean,
    metric_curve,
    metric_summary,
    parse_ints,
    plot_curves,
    run_grid,
    seed_t_interval,
)
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result  # noqa: E402

EXPERIMENT = "fp8-grpo-paper-study"
SEEDS = (0, 1, 2)
FP8_RECIPES = ("blockwise", "rowwise", "tensorwise")
CLIP_PERIOD = 5  # 3 calibrations in the tiny recipes' 15 steps
INTERVALS = (1, 2, 5)
MIN_CALIBRATIONS = 3
BF16_RECIPE, FP8_RECIPE, FP8_KV_RECIPE = "configs/tiny_bf16.yaml", "configs/tiny_fp8_e2e.yaml", "configs/tiny_fp8_e2e_kv.yaml"
# --old-logprobs rollout: pi_old of every arm's ratio is the rollout engine's logprob (loss_fn.old_logprobs), and the
# clip is the only importance-sampling correction
ROLLOUT_OLD = ("loss_fn.old_logprobs=rollout", "loss_fn.use_importance_sampling_correction=false")
KEYS = ("clip/lower_neg_adv_frac", "clip/upper_pos_adv_frac", "policy/entropy", "calib/ratio_error_amplification",
        "clip/bound_low", "clip/bound_high", "calib/bound_low", "calib/bound_high", "time/clip_calibration_s", "time/step_s", "calib/step",
        "calib/bf16_lower_neg_frac", "calib/fp8_lower_neg_frac_at_ref", "calib/fp8_lower_neg_frac_after",
        "async/trajectory_age_mean", "mismatch/token_mult_prob_error", "is/frac_truncated", "is/weight_mean")
# asynchronous runs (grpo.async_grpo): the behaviour policy's distance and what the importance weight does with it
ASYNC = ("async/trajectory_age_mean", "mismatch/token_mult_prob_error", "is/frac_truncated", "is/weight_mean")
PAIRED = ("calib/bf16_lower_neg_frac", "calib/fp8_lower_neg_frac_at_ref", "calib/fp8_lower_neg_frac_after")


def _cc(k: int) -> tuple[str, ...]:
    return ("calibration.calibrated_clipping=true", f"calibration.clip_period={k}")


def make_arms(fp8_recipes=FP8_RECIPES, clip_period: int = CLIP_PERIOD, intervals=INTERVALS,
              ablation_recipe: str = "blockwise", *, old_logprobs: str = "trainer",
              fp8_kv_cache: bool = False) -> tuple[tuple[Arm, ...], dict[int, str]]:
    """The arms (module docstring) and the interval ablation's {K: arm name}. ``old_logprobs="rollout"`` gives every
    arm the engine's logprobs as pi_old (ROLLOUT_OLD); ``fp8_kv_cache`` runs the FP8 arms' rollouts with the FP8 KV
    cache (configs/tiny_fp8_e2e_kv.yaml: the full pipeline)."""
    if old_logprobs not in ("trainer", "rollout"):
        raise ValueError(f"--old-logprobs: trainer or rollout, got {old_logprobs!r}")
    common = ROLLOUT_OLD if old_logprobs == "rollout" else ()
    fp8_cfg = FP8_KV_RECIPE if fp8_kv_cache else FP8_RECIPE
    kv = " + FP8 KV" if fp8_kv_cache else ""
    for r in [*fp8_recipes, ablation_recipe] if intervals else fp8_recipes:
        if r not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipes / --ablation-recipe: unknown FP8 recipe {r!r} (valid: "
                             f"{', '.join(FP8_RECIPES)})")
    if len(set(intervals)) != len(intervals) or any(k < 1 for k in intervals):
        raise ValueError(f"--intervals: distinct integers >= 1 expected, got {list(intervals)}")
    arms = [Arm("bf16", BF16_RECIPE, common, label="BF16")]
    for r in fp8_recipes:
        rec = (*common, f"policy.megatron_cfg.fp8_cfg.fp8_recipe={r}")
        arms.append(Arm(f"fp8-{r}", fp8_cfg, rec, label=f"FP8 {r}{kv}"))
        arms.append(Arm(f"fp8-{r}-cc", fp8_cfg, rec + _cc(clip_period),
                        label=f"FP8 {r}{kv} + CC (K={clip_period})"))
    ablation = {}
    for k in intervals:
        if k == clip_period and ablation_recipe in fp8_recipes:
            ablation[k] = f"fp8-{ablation_recipe}-cc"
            continue
        name = f"fp8-{ablation_recipe}-cc-k{k}"
        arms.append(Arm(name, fp8_cfg, (*common, f"policy.megatron_cfg.fp8_cfg.fp8_recipe={ablation_recipe}",
                                        *_cc(k)), label=f"FP8 {ablation_recipe}{kv} + CC (K={k})"))
        ablation[k] = name
    return tuple(arms), dict(sorted(ablation.items()))


def ablation_only(ablation: dict[int, str]) -> set[str]:
    """The arms that exist only for the interval ablation (``...-cc-k<K>``; the main CC arm stands for its own K)."""
    return {v for v in ablation.values() if re.search(r"-cc-k\d+$", v)}


def select(arms: tuple[Arm, ...], ablation: dict[int, str], names: list[str] | None):
    """Only the arms named (all when None; an unknown name fails naming the valid ones), and the ablation's Ks whose
    arm is among them."""
    if names is None:
        return arms, ablation
    known = [a.name for a in arms]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"--arms: unknown arm(s) {bad} (valid with these settings: {', '.join(known)})")
    return tuple(a for a in arms if a.name in names), {k: v for k, v in ablation.items() if v in names}


def make_grid(arms, seeds, overrides, out_dir, ablation: dict[int, str]) -> Grid:
    return Grid(arms=tuple(arms), seeds=tuple(seeds), root=Path(out_dir).resolve(), common=tuple(overrides),
                kind="paper_study", marker_name="paper_study.json",
                note="The paper's study: BF16 vs vanilla FP8 vs FP8 + Calibrated Clipping per FP8 recipe, ratio-error "
                     "amplification, calibration-interval ablation with the shadow pass's cost (tables in "
                     "paper_study.md, plots under plots/)",
                settings={"arms": [[a.name, a.recipe, list(a.overrides)] for a in arms], "seeds": list(seeds),
                          "overrides": list(overrides), "ablation": {str(k): v for k, v in ablation.items()}})


def check_calibrations(grid: Grid) -> None:
    """Every Calibrated-Clipping arm calibrates >= MIN_CALIBRATIONS times (steps K, 2K, ... <= max_num_steps)."""
    for name, cfg in grid.check_configs().items():
        cal = cfg.calibration
        if not cal.calibrated_clipping:
            continue
        n = cfg.grpo.max_num_steps // cal.clip_period
        if n < MIN_CALIBRATIONS:
            raise ValueError(
                f"calibration.clip_period: K={cal.clip_period} ({name}) calibrates {n} time(s) in "
                f"grpo.max_num_steps={cfg.grpo.max_num_steps} steps; at least {MIN_CALIBRATIONS} are needed (use "
                f"K <= {cfg.grpo.max_num_steps // MIN_CALIBRATIONS} in --intervals / --clip-period, or more steps)")


def _first_last(h: dict[int, float]) -> tuple[float, float]:
    return (h[min(h)], h[max(h)]) if h else (float("nan"), float("nan"))


def _bound_at_end(a: ArmRuns, seed: int, side: str) -> float:
    """The clip bound a run ends with: its last calibration's (``calib/bound_*``, for the steps after it) when
    Calibrated Clipping ran at or after the last step's bounds, else the bound its last step used
    (``clip/bound_*``)."""
    used, calibrated = a.hist[f"clip/bound_{side}"][seed], a.hist[f"calib/bound_{side}"][seed]
    if calibrated and (not used or max(calibrated) >= max(used)):
        return calibrated[max(calibrated)]
    return _first_last(used)[1]


def _shadow(a: ArmRuns) -> dict:
    """The shadow pass's cost per seed -> t intervals over seeds: calibrations per run, seconds per calibration,
    share of the summed step time, share of the run's wall time."""
    n_cal, per_cal, step_share, wall_share = [], [], [], []
    for hc, hs, hstep, summ in zip(a.hist["time/clip_calibration_s"], a.hist["calib/step"], a.hist["time/step_s"],
                                   a.summaries, strict=True):
        total = sum(hc.values())
        n = len(hs)
        n_cal.append(float(n))
        per_cal.append(total / n if n else float("nan"))
        step_share.append(total / sum(hstep.values()) if hstep else float("nan"))
        wall_share.append(total / summ["wall_s"] if summ.get("wall_s") else float("nan"))
    return {"calibrations": seed_t_interval(n_cal), "s_per_calibration": seed_t_interval(per_cal),
            "share_of_step_time": seed_t_interval(step_share), "share_of_wall": seed_t_interval(wall_share)}


def rows(runs: list[ArmRuns], *, n_boot: int = 2000) -> list[dict]:
    out = []
    ref = runs[0] if runs and runs[0].arm.name == "bf16" else None
    for a in runs:
        curve = accuracy_curve(a, n_boot=n_boot)
        last = a.last_val_step
        ent = [_first_last(h) for h in a.hist["policy/entropy"]]
        cc = any(o.startswith("calibration.calibrated_clipping=true") for o in a.arm.overrides)
        out.append({
            "arm": a.arm.name, "label": a.arm.label, "overrides": list(a.arm.overrides), "seeds": a.seeds,
            "calibrated_clipping": cc, "mlflow_run_ids": a.run_ids, "curve": curve, "last_step": last,
            "acc_last": curve[last], "val_prompts": curve[last]["n"] // len(a.seeds),
            "vs_bf16": None if ref is None or a is ref else accuracy_vs(ref, a, n_boot=n_boot),
            "lower_neg_adv_frac": metric_summary(a, "clip/lower_neg_adv_frac"),
            "upper_pos_adv_frac": metric_summary(a, "clip/upper_pos_adv_frac"),
            "entropy_first": mean(e[0] for e in ent), "entropy_last": mean(e[1] for e in ent),
            "ratio_error_amplification": metric_summary(a, "calib/ratio_error_amplification") if cc else None,
            # over-clipping on the same tokens (calibration steps): BF16 shadow at the reference lower bound vs FP8
            # at the same bound, vs FP8 at the calibrated bound; and the FP8/BF16 ratio of the first two, per seed
            "paired": {k: metric_summary(a, k) for k in PAIRED} if cc else None,
            "over_clip_ratio": seed_t_interval([
                (sum(f.values()) / sum(b.values())) if b and sum(b.values()) > 0 else float("nan")
                for b, f in zip(a.hist[PAIRED[0]], a.hist[PAIRED[1]], strict=True)]) if cc else None,
            "bound_low_last": mean(_bound_at_end(a, s, "low") for s in range(len(a.seeds))),
            "bound_high_last": mean(_bound_at_end(a, s, "high") for s in range(len(a.seeds))),
            "step_s": metric_summary(a, "time/step_s"),
            "async": {k: metric_summary(a, k) for k in ASYNC} if any(a.hist["async/trajectory_age_mean"]) and any(
                v > 0 for h in a.hist["async/trajectory_age_mean"] for v in h.values()) else None,
            "mismatch_max": seed_t_interval([max(h.values()) if h else float("nan")
                                             for h in a.hist["mismatch/token_mult_prob_error"]]),
            "shadow": _shadow(a) if cc else None,
            "wall_s": sum(s["wall_s"] for s in a.summaries) / len(a.summaries)})
    return out


def table(rs: list[dict], ablation: dict[int, str], missing: list[str], *, n_boot: int) -> str:
    pct = lambda e: fmt_ci(e, scale=100, digits=2) + "%"  # noqa: E731
    lines = ["| arm | seeds | val accuracy, last validation [95% CI] | vs BF16, " + VS_HEADER + " | clip/lower_neg_adv_frac "
             "[95% CI] | clip/upper_pos_adv_frac | entropy, first -> last step | ratio-error amplification [95% CI] "
             "| clip bounds at the end | step time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_name = {r["arm"]: r for r in rs}
    main = [r for r in rs if r["arm"] not in ablation_only(ablation)]
    for r in main:
        vs = "(reference)" if r["arm"] == "bf16" else fmt_vs(r["vs_bf16"])
        amp = "-" if r["ratio_error_amplification"] is None else fmt_ci(r["ratio_error_amplification"], digits=2)
        lines.append(
            f"| {r['label']} (`{r['arm']}`) | {', '.join(map(str, r['seeds']))} | {fmt_ci(r['acc_last'])} (step "
            f"{r['last_step']}, {r['val_prompts']} prompts) | {vs} | {pct(r['lower_neg_adv_frac'])} | "
            f"{100 * r['upper_pos_adv_frac']['value']:.2f}% | {r['entropy_first']:.3f} -> {r['entropy_last']:.3f} | "
            f"{amp} | [{r['bound_low_last']:.2f}, {r['bound_high_last']:.2f}] | {fmt_ci(r['step_s'], digits=1)} s |")
    lines.append("")
    paired = [r for r in main if r["paired"] is not None]
    if paired:
        lines += ["Over-clipping on the same tokens (every calibration step of the Calibrated-Clipping arms: the BF16 "
                  "shadow and the FP8 policy score the same sampled tokens; fractions of the negative-advantage "
                  "tokens whose ratio falls below the lower bound, where PPO's min silences them):", "",
                  "| arm | seeds | BF16 shadow at the reference L | FP8 at the reference L (what vanilla FP8 "
                  "clips) | FP8 / BF16 | FP8 at the calibrated L | ratio-error amplification |",
                  "|---|---|---|---|---|---|---|"]
        for r in paired:
            pr = r["paired"]
            lines.append(
                f"| {r['label']} (`{r['arm']}`) | {', '.join(map(str, r['seeds']))} | {pct(pr[PAIRED[0]])} | "
                f"{pct(pr[PAIRED[1]])} | {fmt_ci(r['over_clip_ratio'], digits=2)}x | {pct(pr[PAIRED[2]])} | "
                f"{fmt_ci(r['ratio_error_amplification'], digits=2)} |")
        lines.append("")
    asyn = [r for r in main if r["async"] is not None]
    if asyn:
        lines += ["Asynchronous runs: the behaviour policy (the engine, trajectories k versions old, FP8 numerics in "
                  "the FP8 arms) against the trainer's policy, and the importance weight pi_old / pi_rollout that "
                  "corrects both (the PPO ratio itself is taken against the trainer's proximal policy):", "",
                  "| arm | seeds | trajectory age, mean | token-mult-prob-error, mean [95% CI] | largest per run "
                  "(mean of seeds) | IS weights truncated | IS weight, mean |", "|---|---|---|---|---|---|---|"]
        for r in asyn:
            a = r["async"]
            lines.append(
                f"| {r['label']} (`{r['arm']}`) | {', '.join(map(str, r['seeds']))} | "
                f"{a['async/trajectory_age_mean']['value']:.2f} | "
                f"{fmt_ci(a['mismatch/token_mult_prob_error'], digits=4)} | {r['mismatch_max']['value']:.3f} | "
                f"{pct(a['is/frac_truncated'])} | {fmt_ci(a['is/weight_mean'], digits=4)} |")
        lines.append("")
    if ablation:
        lines += ["Calibration-interval ablation (Calibrated Clipping, shadow pass = BF16 forwards of the old and the "
                  "updated policy on calibration steps):", "",
                  "| K | arm | seeds | calibrations per run | shadow pass per calibration | share of step time "
                  "| share of run wall time | ratio-error amplification | clip/lower_neg_adv_frac | val accuracy, last "
                  "| vs BF16, " + VS_HEADER + " |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, name in ablation.items():
            r = by_name.get(name)
            if r is None:
                continue
            sh = r["shadow"]
            vs = fmt_vs(r["vs_bf16"])
            lines.append(
                f"| {k} | `{name}` | {', '.join(map(str, r['seeds']))} | {sh['calibrations']['value']:.1f} | "
                f"{fmt_ci(sh['s_per_calibration'], digits=2)} s | {fmt_ci(sh['share_of_step_time'], scale=100, digits=1)}% "
                f"| {fmt_ci(sh['share_of_wall'], scale=100, digits=1)}% | "
                f"{fmt_ci(r['ratio_error_amplification'], digits=2)} | {pct(r['lower_neg_adv_frac'])} | "
                f"{fmt_ci(r['acc_last'])} | {vs} |")
        lines.append("")
    if missing:
        lines.append(f"Not finished (not in the tables): {', '.join(missing)}.")
    lines.append("Accuracy: near-greedy validation on the main set, mean over seeds, CI from a bootstrap over prompts "
                 "with seeds as strata, the difference paired on the same prompts and seeds (fp8core.stats."
                 f"paired_bootstrap, {n_boot} replicates). Clip fractions: pooled over the optimizer updates after "
                 "the first of each step, mean over steps per seed; those and the other per-step figures: mean over "
                 "seeds with a t interval over seeds (none with one seed). Ratio-error amplification: mean over the "
                 "run's calibrations of mean |r_fp8 - r_bf16| / mean |p_fp8 - p_bf16| (same tokens).")
    return "\n".join(lines) + "\n"


def plots(runs: list[ArmRuns], rs: list[dict], ablation: dict[int, str], plot_dir: Path) -> list[Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    abl_only = ablation_only(ablation)
    main = [a for a in runs if a.arm.name not in abl_only]
    acc = {r["label"]: as_points(r["curve"]) for r in rs if r["arm"] not in abl_only}
    def curve(a: ArmRuns, key: str):
        return metric_curve(a, key, band="range")

    figs = [plot_curves(plot_dir / "paper_study.png",
                        "BF16 vs FP8 vs FP8 + Calibrated Clipping (mean of seeds; accuracy band: 95% CI over prompts, "
                        "other bands: range over seeds)",
                        [("clip/lower_neg_adv_frac", {a.arm.label: curve(a, "clip/lower_neg_adv_frac") for a in main}),
                         ("policy/entropy", {a.arm.label: curve(a, "policy/entropy") for a in main}),
                         ("validation accuracy", acc),
                         ("calib/ratio_error_amplification",
                          {a.arm.label: curve(a, "calib/ratio_error_amplification") for a in main
                           if any(a.hist["calib/ratio_error_amplification"])})])]
    abl = [a for a in runs if a.arm.name in ablation.values()]
    if abl:
        figs.append(plot_curves(plot_dir / "paper_study_intervals.png",
                                "Calibration interval K (mean of seeds, band: range over seeds)",
                                [("clip bound L", {a.arm.label: curve(a, "clip/bound_low") for a in abl}),
                                 ("clip/lower_neg_adv_frac",
                                  {a.arm.label: curve(a, "clip/lower_neg_adv_frac") for a in abl}),
                                 ("shadow pass time per step (s)",
                                  {a.arm.label: curve(a, "time/clip_calibration_s") for a in abl})]))
    return figs


def report(grid: Grid, uri: str, parent: str, ablation: dict[int, str], *, n_boot: int = 2000) -> dict:
    runs, missing = collect(grid, uri, KEYS)
    rs = rows(runs, n_boot=n_boot)
    md = table(rs, ablation, missing, n_boot=n_boot)
    figs = plots(runs, rs, ablation, grid.root / "plots") if runs else []
    log_report(uri, parent, grid.root, {"paper_study.md": md,
                                        "paper_study.json": json.dumps(rs, indent=1, default=str)}, figs)
    print(md, flush=True)
    return {"table": md, "rows": rs, "plots": [str(f) for f in figs], "ablation": ablation}


NOTE = ("The arms, the columns and how to read them: [experiments](../experiments.md#the-papers-study-towards-full-"
        "pipeline-fp8-rl-over-clipping-and-calibrated-clipping).")
FIGURES = {"paper_study.png": "paper study curves", "paper_study_intervals.png": "calibration interval"}


def write_results_doc(result: dict, origin: dict, path: str | Path | None = None) -> Path:
    """The stamped results file of a finished :func:`paper_study` (``result``: what it returned; ``origin``:
    tools.results.stamp taken when the command started): the tables and the figures, copied to ``../img/``."""
    plots = [Path(p) for p in result.get("plots", [])]
    details = [f"- experiment directory: `{shown(result['out_dir'])}`; MLflow parent run "
               f"`{result['parent_run_id']}`"]
    details += result.get("provenance", [])  # every invocation behind the runs (a resumed grid)
    body = result["table"] + "".join(f"\n![{FIGURES.get(p.name, p.stem)}](../img/{p.name})\n" for p in plots)
    return write_result("paper_study", "The paper's study: results", body, origin, note=NOTE, details=details,
                        path=path, images=plots)


@flow(name="fp8-grpo-paper-study", log_prints=False, validate_parameters=True)
def paper_study(seeds: list[int] | None = None, fp8_recipes: list[str] | None = None, clip_period: int = CLIP_PERIOD,
                intervals: list[int] | None = None, ablation_recipe: str = "blockwise",
                overrides: list[str] | None = None, out_dir: str = "runs/paper_study",
                experiment_name: str = EXPERIMENT, tracking_uri: str | None = None, n_boot: int = 2000,
                train: bool = True, arms: list[str] | None = None, old_logprobs: str = "trainer",
                fp8_kv_cache: bool = False) -> dict:
    arms, ablation = select(*make_arms(tuple(FP8_RECIPES if fp8_recipes is None else fp8_recipes), clip_period,
                                       tuple(INTERVALS if intervals is None else intervals), ablation_recipe,
                                       old_logprobs=old_logprobs, fp8_kv_cache=fp8_kv_cache), arms)
    grid = make_grid(arms, list(SEEDS) if seeds is None else seeds, overrides or [], out_dir, ablation)
    check_calibrations(grid)
    return run_grid(grid, experiment=experiment_name, tracking_uri=tracking_uri, train=train,
                    report=lambda g, uri, parent: report(g, uri, parent, ablation, n_boot=n_boot))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m experiments.paper_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated integers")
    ap.add_argument("--fp8-recipes", default=",".join(FP8_RECIPES), help="comma-separated subset of "
                    + ", ".join(FP8_RECIPES))
    ap.add_argument("--clip-period", type=int, default=CLIP_PERIOD, help="K of the main Calibrated-Clipping arms")
    ap.add_argument("--intervals", default=",".join(map(str, INTERVALS)),
                    help="the ablation's K values (comma-separated; empty = no ablation)")
    ap.add_argument("--ablation-recipe", default="blockwise")
    ap.add_argument("--old-logprobs", default="trainer", choices=("trainer", "rollout"),
                    help="pi_old of every arm's ratio: the trainer's logprobs (default) or the rollout engine's")
    ap.add_argument("--fp8-kv-cache", action="store_true",
                    help="the FP8 arms' rollouts with the FP8 KV cache (configs/tiny_fp8_e2e_kv.yaml)")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms these settings make (default: all)")
    ap.add_argument("--out", default="runs/paper_study", help="experiment directory (resumable)")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--table-only", action="store_true", help="no training: the tables of the runs finished so far")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value, applied to every run")
    add_results_doc_args(ap, "paper_study")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    from configs.schema import ConfigError
    from fp8core.cpu import apply_cpu_cap

    try:
        seeds = parse_ints(a.seeds, "--seeds")
        intervals = parse_ints(a.intervals, "--intervals")
        recipes = [s.strip() for s in a.fp8_recipes.split(",") if s.strip()]
        names = None if a.arms is None else [s.strip() for s in a.arms.split(",") if s.strip()]
        arms, ablation = select(*make_arms(tuple(recipes), a.clip_period, tuple(intervals), a.ablation_recipe,
                                           old_logprobs=a.old_logprobs, fp8_kv_cache=a.fp8_kv_cache), names)
        check_calibrations(make_grid(arms, seeds, a.overrides, a.out, ablation))
        apply_cpu_cap()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    origin = stamp("experiments.paper_study", argv)  # the code that runs, before the (hours of) training
    out = paper_study(seeds, recipes, a.clip_period, intervals, a.ablation_recipe, a.overrides, a.out,
                      tracking_uri=a.tracking_uri, n_boot=a.n_boot, train=not a.table_only, arms=names,
                      old_logprobs=a.old_logprobs, fp8_kv_cache=a.fp8_kv_cache)
    doc = results_doc(a)
    if doc is not None and out["rows"]:
        print(f"paper_study: results written to {write_results_doc(out, origin, doc)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
