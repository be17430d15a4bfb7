"""Process memory as the trainer reports it (trainer/memory.py) and the memory bench's table (bench/memory.py)."""
import sys

import pytest

from trainer.memory import peak_bytes, reset_peak, rss_bytes, snapshot

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


@linux
def test_a_reset_peak_sees_a_new_allocation_and_then_forgets_it():
    import mmap

    assert reset_peak()
    before = snapshot()
    assert before["rss"] > 0 and before["peak"] >= before["rss"] - (1 << 20)
    # 64 MiB of fresh pages, every one touched (an mmap of its own: heap memory glibc kept from earlier tests in this
    # process would not raise the RSS)
    x = mmap.mmap(-1, 64 << 20)
    x.write(b"\1" * (64 << 20))
    grown = peak_bytes() - before["rss"]
    x.close()
    assert grown >= 48 << 20, grown  # the allocation's pages (less what the allocator had mapped already)
    reset_peak()
    assert peak_bytes() - rss_bytes() < 8 << 20  # the peak is back near the current RSS


def test_table_takes_the_largest_rank_and_compares_with_one_rank():
    from bench.memory import table

    mb = 1 << 20
    rows = [{"model": "m", "params": 24e6, "world": 1, "baseline_rss": [500 * mb],
             "steps": [{"peak_above_baseline": [300 * mb]}, {"peak_above_baseline": [200 * mb]}]},
            {"model": "m", "params": 24e6, "world": 2, "baseline_rss": [400 * mb, 410 * mb],
             "steps": [{"peak_above_baseline": [150 * mb, 160 * mb]}, {"peak_above_baseline": [90 * mb, 120 * mb]}]}]
    lines = table(rows).splitlines()
    assert lines[2] == "| m | 24.0M | 1 | 500.0 | 300.0 | 200.0 | - |"
    assert lines[3] == "| m | 24.0M | 2 | 410.0 | 160.0 | 120.0 | 0.60x |"


def test_fixed_rollouts_train_every_row():
    from bench.memory import GENERATIONS, PROMPTS, RESPONSE_LEN, fixed_rollouts

    rollouts, rewards = fixed_rollouts(1024)
    assert len(rollouts) == PROMPTS and all(len(r["samples"]) == GENERATIONS for r in rollouts)
    assert all(len(s["token_ids"]) == RESPONSE_LEN and max(s["token_ids"]) < 1024 for r in rollouts
               for s in r["samples"])
    for g in range(PROMPTS):  # both rewards in every group: every advantage is non-zero
        assert set(rewards[g * GENERATIONS:(g + 1) * GENERATIONS]) == {0.0, 1.0}
    assert fixed_rollouts(1024) == (rollouts, rewards)  # fixed: the same for every layout


@pytest.mark.parametrize("args, needle", [(["--sizes", "huge"], "--sizes: unknown ['huge']"),
                                          (["--worlds", "1,x"], "--worlds"), (["--worlds", "0"], "--worlds"),
                                          (["--steps", "0"], "--steps"),
                                          (["policy.no_such_key=1"], "policy.no_such_key")])
def test_bad_arguments_fail_before_any_model_is_built(args, needle, tmp_path, capsys):
    from bench.memory import main

    with pytest.raises(SystemExit):
        main([*args, "--out", str(tmp_path / "out"), "--no-results-doc"])
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
