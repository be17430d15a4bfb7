"""experiments.grid / recipe_table / paper_study on hand-made finished runs (no training): the resume markers, the
seed statistics, the tables' figures (accuracy CIs from per-prompt files, paired differences, per-step means, the
shadow pass's cost) and the plots."""
import json
import math

import pytest

from configs.schema import load_config
from experiments.grid import Arm, Grid, seed_mean, seed_t_interval


def _fake_run(grid: Grid, arm: Arm, seed: int, uri: str, val: dict[int, list[int]], metrics: dict[str, dict],
              wall_s: float = 100.0, trained_by: dict | None = None):
    """A finished run of ``arm`` x ``seed``: MLflow metrics, per-prompt validation files, summary.json, marker."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("t") or c.get_experiment(c.create_experiment("t"))
    run_id = c.create_run(exp.experiment_id).info.run_id
    c.log_batch(run_id, metrics=[Metric(k, float(v), 0, st) for k, h in metrics.items() for st, v in h.items()])
    d = grid.run_dir(arm, seed)
    (d / "val" / "main").mkdir(parents=True)
    files = {}
    for step, vals in val.items():
        f = d / "val" / "main" / f"step_{step:06d}.jsonl"
        f.write_text("".join(json.dumps({"id": i, "correct": bool(v)}) + "\n" for i, v in enumerate(vals)))
        files[str(step)] = str(f)
    (d / "summary.json").write_text(json.dumps({"val_accuracy": {str(s): sum(v) / len(v) for s, v in val.items()},
                                                "val_files": {"main": files}, "wall_s": wall_s}))
    marker = {**grid.marker(arm, seed), "mlflow_run_id": run_id, **({"trained_by": trained_by} if trained_by else {})}
    (d / grid.marker_name).write_text(json.dumps(marker))
    return run_id


def test_grid_markers_order_and_validation(tmp_path):
    a, b = Arm("x", "configs/tiny_bf16.yaml"), Arm("y", "configs/tiny_fp8_e2e.yaml", ("grpo.max_num_steps=3",))
    g = Grid((a, b), (0, 1), tmp_path, common=("grpo.val_period=1",))
    assert [(arm.name, s) for arm, s in g.cells()] == [("x", 0), ("y", 0), ("x", 1), ("y", 1)]  # seed-major
    # every seed on one warm start (bootstrap.sft_seed) unless the grid says otherwise; later overrides win
    assert g.overrides(b) == ["bootstrap.sft_seed=0", "grpo.max_num_steps=3", "grpo.val_period=1"]
    assert Grid((a,), (0,), tmp_path, warm_start_seed=None).overrides(a) == []
    cfgs = [load_config(a.recipe, [*g.overrides(a), f"grpo.seed={s}"]) for s in (0, 1)]
    assert [c.bootstrap.warm_start_seed(c.grpo.seed) for c in cfgs] == [0, 0]
    own = [load_config(a.recipe, [*g.overrides(a), "bootstrap.sft_seed=null", f"grpo.seed={s}"]) for s in (0, 1)]
    assert [c.bootstrap.warm_start_seed(c.grpo.seed) for c in own] == [0, 1]
    assert not g.finished(a, 0)
    d = g.run_dir(a, 0)
    d.mkdir()
    (d / g.marker_name).write_text(json.dumps({**g.marker(a, 0), "mlflow_run_id": "r"}))
    assert not g.finished(a, 0)  # no summary.json: the run did not finish
    (d / "summary.json").write_text("{}")
    assert g.finished(a, 0) and g.done() == {("x", 0)}
    # the same directory under other common overrides (another experiment's settings) is not "finished"
    g2 = Grid((a, b), (0, 1), tmp_path, common=("grpo.val_period=2",))
    assert not g2.finished(a, 0)
    (d / g.marker_name).write_text("{not json")
    assert not g.finished(a, 0)
    with pytest.raises(ValueError, match="duplicate names"):
        Grid((a, a), (0,), tmp_path)
    with pytest.raises(ValueError, match="seeds: duplicates"):
        Grid((a,), (0, 0), tmp_path)
    with pytest.raises(ValueError, match="plain directory name"):
        Arm("a/b", "configs/tiny_bf16.yaml")
    from configs.schema import ConfigError

    with pytest.raises(ConfigError, match="grpo.max_num_stepz: unknown key"):
        Grid((a,), (0,), tmp_path, common=("grpo.max_num_stepz=3",)).check_configs()
    import os

    many = len(os.sched_getaffinity(0)) + 1  # pinning more threads than this machine has fails before training
    with pytest.raises(ConfigError, match="cluster.pin_cpus"):
        Grid((a,), (0,), tmp_path, common=("cluster.pin_cpus=true", f"policy.threads={many}")).check_configs()


def test_seed_statistics():
    e = seed_t_interval([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.3027: half-width 4.3027 / sqrt(3) = 2.4841
    assert e["value"] == 2.0 and e["lo"] == pytest.approx(2.0 - 2.4841, abs=1e-3) and e["n"] == 3
    one = seed_t_interval([0.7])
    assert one["value"] == 0.7 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    m = seed_mean([[1, 1, 0, 0], [1, 0, 0, 0]], n_boot=500)
    assert m["value"] == pytest.approx(0.375) and m["lo"] <= 0.375 <= m["hi"] and m["n"] == 8 and m["lo"] < m["hi"]


def test_metric_curve_bands_and_shift():
    from experiments.grid import ArmRuns, metric_curve

    a = ArmRuns(Arm("x", "configs/tiny_bf16.yaml"), [0, 1, 2], ["r0", "r1", "r2"], [{}, {}, {}],
                {"m": [{1: 1.01, 2: 1.0}, {1: 1.03, 2: 1.0}, {1: 1.02}]}, {})
    t = metric_curve(a, "m")  # step 2 is missing in seed 2: only step 1 is a curve point
    assert list(t) == [1] and t[1][0] == pytest.approx(1.02) and t[1][1] == pytest.approx(1.02 - 0.024841, abs=1e-5)
    r = metric_curve(a, "m", band="range", shift=1.0)
    assert r[1] == pytest.approx((0.02, 0.01, 0.03))
    one = ArmRuns(a.arm, [0], ["r0"], [{}], {"m": [{1: 1.5}]}, {})
    v, lo, hi = metric_curve(one, "m", band="range")[1]
    assert v == 1.5 and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="band"):
        metric_curve(a, "m", band="sd")


def _recipe_metrics(mult, step_s):
    return {"mismatch/token_mult_prob_error": {1: mult, 2: mult + 0.002}, "time/step_s": {1: step_s, 2: step_s + 2},
            "time/rollout_s": {1: 1.0, 2: 1.0}, "time/train_s": {1: 3.0, 2: 3.0}}


def test_recipe_table_from_finished_runs_resumes_parent(tmp_path):
    from experiments.grid import run_grid
    from experiments.recipe_table import ARMS, make_grid, report

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    arms = [a for a in ARMS if a.name in ("bf16", "fp8-e2e", "fp8-e2e-kv")]
    g = make_grid(arms, [0, 1], [], tmp_path / "rt")
    bf16, e2e = arms[0], arms[1]
    # bf16 last-step accuracy 0.75 (seed 0) and 0.5 (seed 1); fp8-e2e 0.5 and 0.5 on the same prompts
    _fake_run(g, bf16, 0, uri, {0: [0, 0, 0, 0], 2: [1, 1, 1, 0]}, _recipe_metrics(1.001, 4.0))
    _fake_run(g, bf16, 1, uri, {0: [0, 0, 0, 0], 2: [1, 1, 0, 0]}, _recipe_metrics(1.003, 6.0))
    _fake_run(g, e2e, 0, uri, {0: [0, 0, 0, 0], 2: [1, 0, 1, 0]}, _recipe_metrics(1.011, 8.0))
    _fake_run(g, e2e, 1, uri, {0: [0, 0, 0, 0], 2: [1, 1, 0, 0]}, _recipe_metrics(1.013, 10.0))
    kw = dict(experiment="t-rt", tracking_uri=uri, train=False)
    r1 = run_grid(g, report=lambda gr, u, p: report(gr, u, p, n_boot=300), **kw)
    rows = {r["arm"]: r for r in r1["rows"]}
    assert set(rows) == {"bf16", "fp8-e2e"}  # fp8-e2e-kv: nothing finished
    b, f = rows["bf16"], rows["fp8-e2e"]
    assert b["acc_last"]["value"] == pytest.approx(0.625) and b["curve"][0]["value"] == 0.0
    assert b["vs_ref"] is None and f["vs_ref"]["value"] == pytest.approx(-0.125) and f["vs_ref"]["seeds"] == [0, 1]
    assert f["vs_ref"]["lo"] <= -0.125 <= f["vs_ref"]["hi"]
    # per-seed means over steps 1.012 and 1.014 -> 1.013; step time (9 + 11) / 2 = 10 with a t interval
    assert f["token_mult_prob_error"]["value"] == pytest.approx(1.013)
    assert f["step_s"]["value"] == pytest.approx(10.0) and f["step_s"]["lo"] < 10.0 < f["step_s"]["hi"]
    t = r1["table"]
    assert "| end-to-end FP8 (`fp8-e2e`) | 0, 1 | 0.500 [" in t and "| 0: 0.000 / 2: 0.625 |" in t
    # per seed -25.0 and +0.0 points: over two seeds the t interval is -12.5 +- 12.71 * 17.68 / sqrt(2)
    assert f["vs_ref"]["per_seed"] == pytest.approx([-0.25, 0.0])
    assert f["vs_ref"]["over_seeds"]["lo"] == pytest.approx(-0.125 - 12.7062 * 0.1767767 / 2 ** 0.5, abs=1e-4)
    assert "; per seed -25.0 / +0.0; over seeds [-171.3, +146.3], no difference shown (seeds 0, 1)" in t
    assert "**" not in t.split("\n")[3]
    assert "Not finished (not in the table): fp8-e2e-kv seed 0, fp8-e2e-kv seed 1." in t
    assert (tmp_path / "rt" / "recipe_table.md").read_text() == t
    assert (tmp_path / "rt" / "plots" / "recipe_table.png").stat().st_size > 10_000
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    arts = {a.path for a in c.list_artifacts(r1["parent_run_id"])}
    assert {"recipe_table.md", "plots"} <= arts
    assert c.get_run(r1["parent_run_id"]).info.status == "FINISHED"
    r2 = run_grid(g, report=lambda gr, u, p: report(gr, u, p, n_boot=300), **kw)  # a rerun reuses the parent
    assert r2["parent_run_id"] == r1["parent_run_id"] and r2["rows"][1]["vs_ref"] == f["vs_ref"]


def test_recipe_table_results_file(tmp_path):
    """What ``python -m experiments.recipe_table`` writes when it finishes: the stamped results file with the table
    and the figure, copied to ../img/ beside it."""
    from experiments.grid import run_grid
    from experiments.recipe_table import ARMS, make_grid, report, write_results_doc
    from tools.results import stamp

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    g = make_grid(ARMS[:1], [0], [], tmp_path / "rt")
    _fake_run(g, ARMS[0], 0, uri, {0: [0, 0, 0, 0], 2: [1, 1, 1, 0]}, _recipe_metrics(1.001, 4.0))
    r = run_grid(g, experiment="t-rt", tracking_uri=uri, train=False,
                 report=lambda gr, u, p: report(gr, u, p, n_boot=100))
    origin = stamp("experiments.recipe_table", ["--out", str(tmp_path / "rt")])
    doc = write_results_doc(r, origin, tmp_path / "docs" / "results" / "recipe_table.md")
    text = doc.read_text()
    assert text.startswith("# Recipe table: results\n\nWritten by `") and \
        "-m experiments.recipe_table`; the next run of that command overwrites this file." in text
    for line in (f"- commit: `{origin['commit']}`", f"- date: {origin['date']}",
                 f"- CPU: {origin['cpu_model']} (kind `{origin['cpu_kind']}`)", f"- command: `{origin['command']}`",
                 f"MLflow parent run `{r['parent_run_id']}`", r["table"].strip(),
                 "![recipe table curves](../img/recipe_table.png)"):
        assert line in text
    assert (tmp_path / "docs" / "img" / "recipe_table.png").read_bytes() == \
        (tmp_path / "rt" / "plots" / "recipe_table.png").read_bytes()


def test_paper_study_tables_and_shadow_cost(tmp_path):
    from experiments.grid import run_grid
    from experiments.paper_study import check_calibrations, make_arms, make_grid, report

    arms, ablation = make_arms(("blockwise",), 2, (1, 2), "blockwise")
    assert [a.name for a in arms] == ["bf16", "fp8-blockwise", "fp8-blockwise-cc", "fp8-blockwise-cc-k1"]
    assert ablation == {1: "fp8-blockwise-cc-k1", 2: "fp8-blockwise-cc"}
    over = ["grpo.max_num_steps=6"]
    g = make_grid(arms, [0], over, tmp_path / "ps", ablation)
    with pytest.raises(ValueError, match=r"K=2 \(fp8-blockwise-cc\) calibrates 1 time"):
        check_calibrations(make_grid(arms, [0], ["grpo.max_num_steps=3"], tmp_path / "ps", ablation))
    check_calibrations(g)  # 6 // 2 = 3 and 6 // 1 = 6 calibrations
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    steps = (1, 2, 3, 4, 5, 6)

    def metrics(lower, amp=None, cal_steps=(), cal_s=0.5):
        m = {"clip/lower_neg_adv_frac": dict.fromkeys(steps, lower), "clip/upper_pos_adv_frac": dict.fromkeys(steps, 0.01),
             "policy/entropy": {s: 0.55 - 0.05 * s for s in steps}, "clip/bound_low": dict.fromkeys(steps, 0.8),
             "clip/bound_high": dict.fromkeys(steps, 1.28), "time/step_s": dict.fromkeys(steps, 5.0),
             "time/clip_calibration_s": {s: (cal_s if s in cal_steps else 0.0) for s in steps}}
        if amp is not None:
            m["calib/ratio_error_amplification"] = {s: amp + s for s in cal_steps}
            m["calib/step"] = {s: float(s) for s in cal_steps}
            m["calib/bf16_lower_neg_frac"] = dict.fromkeys(cal_steps, 0.01)
            m["calib/fp8_lower_neg_frac_at_ref"] = {s: 0.02 + 0.01 * (s % 4 == 0) for s in cal_steps}
            m["calib/fp8_lower_neg_frac_after"] = dict.fromkeys(cal_steps, 0.011)
            # each calibration's bounds, for the steps after it (the steps log the bounds they used: 0.8 / 1.28)
            m["calib/bound_low"] = {s: 0.8 - 0.01 * s for s in cal_steps}
            m["calib/bound_high"] = {s: 1.28 + 0.1 * s for s in cal_steps}
        return m

    val = {0: [0, 0, 0, 0], 6: [1, 1, 0, 0]}
    _fake_run(g, arms[0], 0, uri, val, metrics(0.01))
    asyn = {"async/trajectory_age_mean": {s: float(s > 1) for s in steps},  # step 1 is synchronous
            "mismatch/token_mult_prob_error": {s: 1.5 if s == 3 else 1.01 for s in steps},
            "is/frac_truncated": dict.fromkeys(steps, 0.002), "is/weight_mean": dict.fromkeys(steps, 0.999)}
    _fake_run(g, arms[1], 0, uri, {0: [0, 0, 0, 0], 6: [1, 0, 0, 0]}, {**metrics(0.04), **asyn})
    _fake_run(g, arms[2], 0, uri, val, metrics(0.012, amp=1.0, cal_steps=(2, 4, 6)), wall_s=40.0)
    _fake_run(g, arms[3], 0, uri, val, metrics(0.011, amp=2.0, cal_steps=steps, cal_s=1.0), wall_s=60.0)
    out = run_grid(g, experiment="t-ps", tracking_uri=uri, train=False,
                   report=lambda gr, u, p: report(gr, u, p, ablation, n_boot=300))
    rows = {r["arm"]: r for r in out["rows"]}
    assert rows["fp8-blockwise"]["vs_bf16"]["value"] == pytest.approx(-0.25)
    assert rows["fp8-blockwise"]["lower_neg_adv_frac"]["value"] == pytest.approx(0.04)
    assert rows["fp8-blockwise"]["ratio_error_amplification"] is None and rows["fp8-blockwise"]["shadow"] is None
    cc, k1 = rows["fp8-blockwise-cc"], rows["fp8-blockwise-cc-k1"]
    assert cc["ratio_error_amplification"]["value"] == pytest.approx(5.0)  # steps 2, 4, 6: 1 + step
    assert cc["shadow"]["calibrations"]["value"] == 3 and cc["shadow"]["s_per_calibration"]["value"] == 0.5
    assert cc["shadow"]["share_of_step_time"]["value"] == pytest.approx(1.5 / 30.0)
    assert cc["shadow"]["share_of_wall"]["value"] == pytest.approx(1.5 / 40.0)
    assert k1["shadow"]["calibrations"]["value"] == 6 and k1["shadow"]["share_of_wall"]["value"] == pytest.approx(0.1)
    assert cc["entropy_first"] == pytest.approx(0.5) and cc["entropy_last"] == pytest.approx(0.25)
    # the bounds a run ends with: the last calibration's (step 6) where it ran last; the used ones without CC
    assert (cc["bound_low_last"], cc["bound_high_last"]) == pytest.approx((0.74, 1.88))
    assert (rows["bf16"]["bound_low_last"], rows["bf16"]["bound_high_last"]) == pytest.approx((0.8, 1.28))
    # paired over-clipping (cc: steps 2, 4, 6 -> FP8 at the reference L 0.02, 0.03, 0.02 vs BF16 0.01 each)
    assert cc["paired"]["calib/fp8_lower_neg_frac_at_ref"]["value"] == pytest.approx(0.07 / 3)
    assert cc["over_clip_ratio"]["value"] == pytest.approx(0.07 / 0.03)
    assert rows["fp8-blockwise"]["paired"] is None
    # asynchronous section: only runs whose trajectories were older than 0 steps; mismatch mean (5 x 1.01 + 1.5) / 6
    assert rows["bf16"]["async"] is None and rows["fp8-blockwise"]["mismatch_max"]["value"] == pytest.approx(1.5)
    assert ("| FP8 blockwise (`fp8-blockwise`) | 0 | 0.83 | 1.0917 | 1.500 | 0.20% | 0.9990 |"
            in out["table"].split("Asynchronous runs")[1])
    t = out["table"]
    main_table, abl_table = t.split("Calibration-interval ablation")
    over = main_table.split("Over-clipping on the same tokens")[1]
    assert "| FP8 blockwise + CC (K=2) (`fp8-blockwise-cc`) | 0 | 1.00% | 2.33% | 2.33x | 1.10% | 5.00 |" in over
    assert "`fp8-blockwise-cc-k1`" not in main_table and "`fp8-blockwise-cc`" in main_table
    assert "| 1 | `fp8-blockwise-cc-k1` |" in abl_table and "| 2 | `fp8-blockwise-cc` |" in abl_table
    assert "| 10.0% |" in abl_table  # k1: 6 x 1 s of 60 s wall time
    for png in ("paper_study.png", "paper_study_intervals.png"):
        assert (tmp_path / "ps" / "plots" / png).stat().st_size > 10_000


def test_paper_study_rollout_old_and_fp8_kv_arms(tmp_path):
    """--old-logprobs rollout gives every arm the engine's logprobs as pi_old with no second IS weight;
    --fp8-kv-cache puts the FP8 arms (not BF16) on the FP8 KV cache; the configs load and validate."""
    from experiments.paper_study import make_arms, make_grid

    arms, ablation = make_arms(("blockwise",), 2, (), "blockwise", old_logprobs="rollout", fp8_kv_cache=True)
    cfgs = make_grid(arms, [0], ["grpo.max_num_steps=6"], tmp_path / "ps", ablation).check_configs()
    assert set(cfgs) == {"bf16", "fp8-blockwise", "fp8-blockwise-cc"}
    for name, c in cfgs.items():
        assert c.loss_fn.old_logprobs == "rollout" and not c.loss_fn.use_importance_sampling_correction, name
        assert c.policy.generation.vllm_cfg.kv_cache_dtype == ("auto" if name == "bf16" else "fp8"), name
    plain = make_grid(make_arms(("blockwise",), 2, ())[0], [0], [], tmp_path / "p2", {}).check_configs()
    assert all(c.loss_fn.old_logprobs == "trainer" for c in plain.values())
    assert plain["fp8-blockwise"].policy.generation.vllm_cfg.kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="--old-logprobs"):
        make_arms(("blockwise",), 2, (), old_logprobs="engine")


def test_a_difference_is_claimed_only_when_the_interval_over_seeds_excludes_zero():
    from experiments.grid import fmt_vs, seed_t_interval

    def vs(per_seed):
        m = sum(per_seed) / len(per_seed)
        return {"value": m, "lo": m - 0.01, "hi": m + 0.01, "per_seed": per_seed, "over_seeds": seed_t_interval(per_seed)}

    # the paper-study case: a tight prompt bootstrap, seeds that disagree
    text = fmt_vs(vs([-0.214, -0.016, 0.008]))
    assert text == "-7.4 [-8.4, -6.4]; per seed -21.4 / -1.6 / +0.8; over seeds [-37.7, +22.9], no difference shown"
    text = fmt_vs(vs([-0.038, -0.026, -0.018]))
    assert text.startswith("**-2.7 [") and text.endswith("over seeds [-5.2, -0.2]**")
    assert fmt_vs(vs([0.05])).endswith("; per seed +5.0; one seed, no interval over seeds") and fmt_vs(None) == "n/a"


def test_a_resumed_grid_names_every_invocation_behind_its_runs(tmp_path):
    """Runs trained by two invocations (different commits, days, CPU kinds) and one run from before runs recorded
    their origin: the results file's provenance names each, with its runs; an unfinished run is in none."""
    from experiments.grid import provenance
    from tools.results import invocation

    a, b = Arm("bf16", "configs/tiny_bf16.yaml"), Arm("fp8", "configs/tiny_fp8_e2e.yaml")
    g = Grid((a, b), (0, 1, 2), tmp_path / "g")
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    first = {"commit": "abc1234", "dirty_files": [], "date": "2026-12-01 10:00 UTC", "cpu_kind": "avx2",
             "cpu_model": "AMD EPYC", "command": ".venv/bin/python -m experiments.x --seeds 0"}
    second = {**invocation(), "command": ".venv/bin/python -m experiments.x"}
    val = {0: [0, 1], 2: [1, 1]}
    _fake_run(g, a, 0, uri, val, {}, trained_by=first)
    _fake_run(g, b, 0, uri, val, {}, trained_by=first)
    _fake_run(g, a, 1, uri, val, {}, trained_by=second)
    _fake_run(g, b, 1, uri, val, {})  # trained before markers carried an origin
    lines = provenance(g)
    assert lines[0] == ("- runs trained at commit `abc1234`, 2026-12-01 10:00 UTC, CPU AMD EPYC (kind `avx2`), by "
                        "`.venv/bin/python -m experiments.x --seeds 0`: bf16 seed 0, fp8 seed 0")
    assert lines[1].startswith(f"- runs trained at commit `{second['commit']}") and \
        f"(kind `{second['cpu_kind']}`)" in lines[1] and lines[1].endswith(": bf16 seed 1")
    assert lines[2] == ("- runs trained before grid runs recorded their origin (commit, date and CPU not recorded): "
                        "fp8 seed 1")
    assert len(lines) == 3  # seed 2 never ran
