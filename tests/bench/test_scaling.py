"""bench/scaling.py: the layout table and the argument checks (the runs themselves are real flow runs, README)."""
import pytest

from bench.scaling import main, table


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
