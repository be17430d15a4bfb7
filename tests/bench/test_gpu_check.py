"""bench/gpu_check.py's CPU-runnable parts: on CPU the scaled_mm backend (torch._scaled_mm, slow but exact
accumulation) must agree with the emulation for every recipe and format well within the stated tolerance, and
the JSON must carry every section the README table reads."""
import json

from bench import gpu_check


def test_gpu_check_runs_on_cpu_and_every_recipe_agrees(tmp_path):
    out = tmp_path / "g.json"
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["all_agree"]
    combos = {(r["recipe"], r["fmt"]) for r in res["agreement"]}
    assert combos == {(r, f) for r in gpu_check.RECIPES for f in gpu_check.FORMATS}
    for r in res["agreement"]:
        assert max(r["rel_fwd"], r["rel_dgrad"], r["rel_wgrad"]) < 1e-5  # exact FP32 accumulation on CPU
    assert {"available"} <= set(res["blockwise_scaled_mm"])
    speed = res["linear_speed"][0]
    assert speed["bf16_ms"] > 0 and all(speed[f"fp8_{r}_over_bf16"] > 0 for r in gpu_check.RECIPES)
    assert res["quantize"]["copy_gbps"] > 0 and res["quantize"]["block128_gbps"] > 0


def test_agreement_detects_a_wrong_scale(monkeypatch):
    """The check is not vacuous: a scaled_mm backend that mis-scales one operand fails the tolerance."""
    import fp8core.linear as lin

    real = lin._fp8_mm_scaled
    monkeypatch.setattr(lin, "_fp8_mm_scaled", lambda a, b: real(a, b) * 1.01)
    rows = gpu_check.agreement(__import__("torch").device("cpu"), (128, 256, 128))
    assert not any(r["ok"] for r in rows)
