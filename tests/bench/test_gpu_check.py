"""bench/gpu_check.py's CPU-runnable parts: on CPU the scaled_mm backend (torch._scaled_mm, slow but exact
accumulation) must agree with the emulation for every recipe and format well within the stated tolerance, the
quantizer without host reads must give the CPU quantizer's bits, the tiny model's FP8 step must stay finite, and
the JSON must carry every section (versions, paths) the docs read; gpu_check.sh says in one line when no torch here
sees a GPU."""
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
    assert res["torch"] == __import__("torch").__version__ and "blockwise_scaled_mm_in_torch" in res
    assert res["blockwise_gemms"]["ok"] and max(res["blockwise_gemms"][f"rel_{g}"] for g in ("fwd", "dgrad", "wgrad")) < 1e-5
    assert res["paths"]["blockwise_e4m3"].startswith("chunked")  # a CPU's torch rejects blockwise scaling
    assert res["quantizer_bits"] and all(r["bit_identical"] for r in res["quantizer_bits"])
    step = res["tiny_train_step"]
    assert step["fp8_linears"] == 28 and all(step[f"{a}_finite"] for a in ("fp8", "fp32", "bf16_autocast"))
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


def test_the_script_says_in_one_line_when_no_torch_sees_a_gpu(tmp_path):
    """On a machine whose torch builds see no CUDA device (CI's), gpu_check.sh exits 2 naming each python it tried
    and its torch, without a traceback."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), str(tmp_path / "g.json")], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "no python here has a torch that sees a CUDA device" in out.stderr
    assert "torch " in out.stderr and "Traceback" not in out.stderr and not (tmp_path / "g.json").exists()
