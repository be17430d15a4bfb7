"""bench/scaling.py: the layout table and the argument checks (the runs themselves are real flow runs, README)."""
import pytest

from bench.scaling import drift_corrected_ratio, main, pair_order, table


def test_table_rows_and_missing_values():
    row = {"layout": "2+2", "time/step_s": 10.126, "time/rollout_s": 5.6, "time/train_s": 3.66,
           "throughput/rollout_tokens_per_s": 894.35, "time/refit_s": 0.5, "time/refit_engine_mean_s": 0.21,
           "time/refit_engine_s": None}
    t = table([row]).splitlines()
    assert t[0].startswith("| engines + trainers | step s |") and len(t) == 3
    assert t[2] == "| 2+2 | 10.13 | 5.60 | 894 | 0.50 | 0.21 / - | 3.66 |"


@pytest.mark.parametrize("args, msg", [(["--layouts", "1x1"], "is not N+M"), (["--layouts", "0+1"], "at least one"),
                                       (["--baseline-tree", "/nonexistent"], "not a checkout")])
def test_bad_arguments_fail_before_any_run(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_results_file(tmp_path):
    """What ``python -m bench.scaling`` writes when it finishes: the stamped results file with the layout table and
    the baseline comparison."""
    from bench.scaling import write_results_doc
    from tools.results import stamp

    origin = stamp("bench.scaling", ["--layouts", "1+1"])
    rows = [{"layout": "1+1", "time/step_s": 6.76, "time/rollout_s": 2.21, "time/train_s": 4.25,
             "throughput/rollout_tokens_per_s": 2309, "time/refit_s": 0.19, "time/refit_engine_mean_s": 0.08,
             "time/refit_engine_s": 0.08}]
    doc = write_results_doc(rows, "1+1 step time, this tree / baseline: 1.019", origin, recipe="configs/x.yaml",
                            steps=5, out=tmp_path / "runs", path=tmp_path / "scaling.md")
    text = doc.read_text()
    assert text.startswith("# Scaling: results\n\nWritten by `") and "-m bench.scaling`; the next run" in text
    assert f"- command: `{origin['command']}`" in text and "`configs/x.yaml`" in text and "steps 2-5" in text
    assert "| 1+1 | 6.76 | 2.21 | 2309 |" in text and text.endswith("this tree / baseline: 1.019\n")


def test_failed_layout_row():
    t = table([{"layout": "2+2", "failed": "2+2: flow failed (rc 1)"}]).splitlines()
    assert t[2] == "| 2+2 | failed: 2+2: flow failed (rc 1) | | | | | |"


def test_pairs_alternate_abba():
    assert [k for i in range(3) for k in pair_order(i)] == ["baseline", "head", "head", "baseline", "baseline", "head"]


def test_drift_corrected_ratio_removes_a_linear_drift():
    # a machine that gets 3% slower per run, head truly 2% slower than baseline, ABBA order
    order = [k for i in range(3) for k in pair_order(i)]
    runs = [(k == "head", 10.0 * 1.03 ** j * (1.02 if k == "head" else 1.0)) for j, k in enumerate(order)]
    est, lo, hi = drift_corrected_ratio(runs)
    assert est == pytest.approx(1.02, rel=1e-9) and lo <= est <= hi
    naive = (sum(v for h, v in runs if h) / 3) / (sum(v for h, v in runs if not h) / 3)
    assert abs(naive - 1.02) > 1e-3  # the plain ratio is biased by the drift, the fit is not
    with pytest.raises(ValueError, match=">= 4 runs"):
        drift_corrected_ratio(runs[:3])
