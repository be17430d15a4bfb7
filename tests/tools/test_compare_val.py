"""tools.compare_val on hand-made run directories: gain (end - start) and candidate - base, paired per prompt."""
import json

import pytest

from tools.compare_val import diff, gain, main


def _run(tmp_path, name, by_step):
    d = tmp_path / name
    files = {}
    for step, correct in by_step.items():
        p = d / "val" / "main" / f"step_{step:06d}.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps({"id": i, "correct": bool(c)}) + "\n" for i, c in enumerate(correct)))
        files[str(step)] = str(p)
    (d / "summary.json").write_text(json.dumps({"val_files": {"main": files}}))
    return str(d)


def test_gain_and_diff(tmp_path, capsys):
    r0 = _run(tmp_path, "s0", {0: [0, 0, 0, 1], 5: [1, 0, 0, 1], 10: [1, 1, 0, 1]})  # gain 0.5
    r1 = _run(tmp_path, "s1", {0: [0, 0, 0, 0], 5: [0, 0, 0, 0], 10: [1, 0, 0, 0]})  # gain 0.25
    g = gain([r0, r1], n_boot=2000)
    assert g.value == pytest.approx(0.375) and g.lo <= 0.375 <= g.hi and g.n == 8
    assert gain([r0], end="5").value == pytest.approx(0.25)
    d = diff([r1], [r0], n_boot=2000)  # at the last step: [1,1,0,1] - [1,0,0,0]
    assert d.value == pytest.approx(0.5)
    m = diff([r1], [r0], mean_over_steps=True)  # steps 5 and 10 averaged per prompt: [1,.5,0,1] - [.5,0,0,0]
    assert m.value == pytest.approx(0.5)
    assert main(["gain", r0, r1, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["value"] == pytest.approx(0.375) and "gain" in out["what"]
    with pytest.raises(SystemExit, match="no per-prompt validation files"):
        gain([str(tmp_path)], set_name="main") if (tmp_path / "summary.json").write_text("{}") else None


def test_diff_interval_over_seeds(tmp_path, capsys):
    """Three seeds whose candidate gains 1, 2 and 3 of 4 prompts: per-seed differences 0.25 / 0.5 / 0.75, SD 0.25,
    t(0.975, 2) = 4.3027, so the interval over seeds is 0.5 +- 4.3027 * 0.25 / sqrt(3) = 0.5 +- 0.6210."""
    base = [_run(tmp_path, f"b{s}", {0: [0, 0, 0, 0], 5: [0, 0, 0, 0]}) for s in range(3)]
    cand = [_run(tmp_path, f"c{s}", {0: [0, 0, 0, 0], 5: [1] * (s + 1) + [0] * (3 - s)}) for s in range(3)]
    assert main(["diff", "--base", ",".join(base), "--cand", ",".join(cand), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["value"] == pytest.approx(0.5) and out["seed_sd"] == pytest.approx(0.25) and out["seeds"] == 3
    assert out["seeds_lo"] == pytest.approx(0.5 - 0.6210, abs=1e-4)
    assert out["seeds_hi"] == pytest.approx(0.5 + 0.6210, abs=1e-4)
    assert main(["diff", "--base", ",".join(base), "--cand", ",".join(cand)]) == 0
    assert "over the 3 seeds [t 95% CI -0.1210, +1.1210]" in capsys.readouterr().out
    assert main(["diff", "--base", base[0], "--cand", cand[0]]) == 0  # one seed: no interval over seeds
    assert "over the" not in capsys.readouterr().out
