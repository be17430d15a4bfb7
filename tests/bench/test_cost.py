"""bench.cost: the growth exponent, the tables and bad arguments (the measurement itself is the command's)."""
import pytest

from bench.cost import growth_exponent, main, tables


def test_growth_exponent_is_the_log_log_slope():
    assert growth_exponent([(1e6, 2.0), (4e6, 8.0), (16e6, 32.0)]) == pytest.approx(1.0)
    assert growth_exponent([(1e6, 3.0), (1e8, 30.0)]) == pytest.approx(0.5)
    assert growth_exponent([(1e6, 3.0)]) is None


def test_tables_pair_the_recipes_and_fit_per_recipe_and_m():
    rows = [{"size": s, "params": p, "recipe": r, "world": 1, "response_len": 64, "step_s": t, "tokens_per_s": 1536 / t,
             "peak_mb": m} for s, p, r, t, m in [("small", 1e6, "bf16", 1.0, 100.0), ("small", 1e6, "fp8", 1.5, 110.0),
                                                 ("large", 1e8, "bf16", 10.0, 1000.0),
                                                 ("large", 1e8, "fp8", 12.0, 1100.0)]]
    full = [{"size": "small", "recipe": "bf16", "step_s": 2.0, "rollout_s": 1.0, "train_s": 1.0,
             "generated_tokens": 4096, "mismatch": 1.003},
            {"size": "small", "recipe": "fp8", "step_s": 2.6, "rollout_s": 1.4, "train_s": 1.2,
             "generated_tokens": 4096, "mismatch": 1.025}]
    text = tables(rows, full)
    assert "| small | 1.0M | 1 | 64 | 1.00 | 1536 | 100 | 1.50 | 1024 | 110 | 1.50x |" in text
    assert "| bf16 | 1 | 0.50 | 0.50 |" in text and "| small | fp8 | 2.60 | 1.40 | 1.20 | 4096 | 1.0250 | 1.30x |" in text


@pytest.mark.parametrize("args, needle", [(["--sizes", "huge"], "--sizes"), (["--worlds", "0"], "--worlds"),
                                          (["--full-sizes", "tiny"], "--full-sizes")])
def test_bad_arguments_fail_before_any_work(args, needle, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*args, "--out", str(tmp_path / "out"), "--no-results-doc"])
    assert needle in capsys.readouterr().err and not (tmp_path / "out").exists()
