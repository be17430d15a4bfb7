"""Process memory as the trainer reports it (process/memory.py) and the memory bench's table (bench/memory.py)."""
import sys

import pytest

from process.memory import peak_bytes, reset_peak, rss_bytes, snapshot

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


def test_table_takes_the_largest_rank_and_compares_with_one_rank_and_the_model():
    from bench.memory import table, terms_table

    mb = 1 << 20
    rows = [{"model": "probe", "params": 0.4e6, "world": 1, "baseline_rss": [450 * mb],
             "steps": [{"peak_above_baseline": [30 * mb]}, {"peak_above_baseline": [25 * mb]}],
             "predicted": {"optimizer": 5 * mb, "process_constant": 20 * mb, "total": 25 * mb}},
            {"model": "m", "params": 24e6, "world": 1, "baseline_rss": [500 * mb],
             "steps": [{"peak_above_baseline": [300 * mb]}, {"peak_above_baseline": [200 * mb]}],
             "predicted": {"optimizer": 150 * mb, "process_constant": 20 * mb, "total": 250 * mb}},
            {"model": "m", "params": 24e6, "world": 2, "baseline_rss": [400 * mb, 410 * mb],
             "steps": [{"peak_above_baseline": [150 * mb, 160 * mb]}, {"peak_above_baseline": [90 * mb, 120 * mb]}]}]
    lines = table(rows).splitlines()
    assert lines[2] == "| probe (constant 20.0) | 0.4M | 1 | 450.0 | 30.0 | 25.0 | - | - | - |"
    assert lines[3] == "| m | 24.0M | 1 | 500.0 | 300.0 | 200.0 | - | 250.0 | 0.80 |"
    assert lines[4] == "| m | 24.0M | 2 | 410.0 | 160.0 | 120.0 | 0.60x | - | - |"
    terms = terms_table(rows).splitlines()
    assert terms[0] == "| model | M | optimizer | process constant | total | measured |"
    assert terms[2:] == ["| m | 1 | 150.0 | 20.0 | 250.0 | 200.0 |"]


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc: Linux only")
@pytest.mark.parametrize("heap, stays", [("keep", True), ("return", False)])
def test_heap_policy_decides_whether_freed_tensors_leave_the_resident_set(heap, stays):
    """FP8GRPO_TRAINER_HEAP (process.memory.HEAP_POLICIES): ``keep`` (the trainer's default) leaves a freed 64 MB
    tensor's pages resident, ``return`` (what ``bench.memory --heap return`` measures with) gives them back; each in
    a fresh process, since the setting is per process."""
    import subprocess

    # keep first in both: glibc's own default already returns blocks this large, so "return" must undo "keep"
    code = ("import torch\nfrom process.memory import rss_bytes\nfrom process.memory import HEAP_POLICIES\n"
            f"assert HEAP_POLICIES['keep']() and HEAP_POLICIES[{heap!r}]()\n"
            "before = rss_bytes()\nt = torch.ones(16 << 20)\ndel t\nprint((rss_bytes() - before) >> 20)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    kept_mb = int(out.stdout.split()[-1])
    assert (kept_mb >= 48) if stays else (kept_mb < 8), (heap, kept_mb)
