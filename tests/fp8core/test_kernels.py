"""The fused C++ quantize-dequantize kernel (fp8core.kernels) against the torch path of fp8core.quant, bit for bit.

The torch path is itself tested bit for bit against ``quantize_reference`` + ``dequantize`` (test_quant.py), so
agreement here means the kernel computes exactly the FP8 emulation's values."""
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fp8core import kernels, quant
from fp8core.quant import GRANULARITIES, quantize, quantize_dequantize, quantize_dequantize_columns, quantize_reference

# Skipped only where this machine has no kernel to build; where it should build, a failed build fails every test
# here (the fixture below), it is never a skip.
pytestmark = pytest.mark.skipif(kernels.no_kernel_reason() is not None,
                                reason=f"no kernel for this machine: {kernels.no_kernel_reason()}")


@pytest.fixture(autouse=True, scope="module")
def _kernel_built():
    if kernels.load() is None:
        pytest.fail(f"fp8core/csrc should build on this machine and did not: {kernels.describe()}", pytrace=False)


@contextmanager
def torch_path():
    """Run fp8core.quant with the kernel switched off (the torch ops path), restoring the loaded module after."""
    saved = dict(kernels._state)
    kernels._state.update(module=None, choice="torch (test)")
    try:
        yield
    finally:
        kernels._state.clear()
        kernels._state.update(saved)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _inputs():
    g = torch.Generator().manual_seed(1)
    shapes = [(1, 1), (3, 127), (5, 128), (7, 129), (130, 300), (256, 256), (129, 1), (1, 700)]
    for i, (m, k) in enumerate(shapes):
        x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 5)
        yield f"random{i}", x
    edge = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 448.0, 449.0, -1e6,
                         464.0, 2.0**-6, 2.0**-7 * 1.0625, 57344.0, 3.0e38, -3.0e38, 1.5, 2.5, -2.5])
    yield "edges", edge.repeat(3, 7)[:, :130].contiguous()
    yield "zeros", torch.zeros(4, 256)
    yield "tiny", torch.full((2, 200), 1e-38)
    half_zero = torch.randn(140, 260, generator=g)
    half_zero[:70] = 0
    yield "half_zero", half_zero


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("granularity", ["group128", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_bit_identical_to_torch_path(fmt, pow2, granularity, dtype):
    for name, x in _inputs():
        x = x.to(dtype)
        got_rows = quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2)[0]
        got_cols = quantize_dequantize_columns(x, granularity, fmt=fmt, pow2=pow2)
        with torch_path():
            ref_rows = quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2)[0]
            ref_cols = quantize_dequantize_columns(x, granularity, fmt=fmt, pow2=pow2)
        assert torch.equal(bits(got_rows), bits(ref_rows)), (name, "rows")
        assert torch.equal(bits(got_cols), bits(ref_cols)), (name, "cols")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_codes_and_scales_bit_identical(fmt, pow2, granularity, dtype):
    """quantize() (FP8 codes + scales) and quantize_dequantize(keep_data=True) through the kernel equal the torch
    path byte for byte, for every granularity (block128 and tensorwise included)."""
    for name, x in _inputs():
        x = x.to(dtype)
        q = quantize(x, granularity, fmt=fmt, pow2=pow2)
        dq, qk = quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2, keep_data=True)
        with torch_path():
            r = quantize(x, granularity, fmt=fmt, pow2=pow2)
            rdq, rk = quantize_dequantize(x, granularity, fmt=fmt, pow2=pow2, keep_data=True)
        for a, b in ((q, r), (qk, rk)):
            assert a.data.dtype == b.data.dtype and a.scale.shape == b.scale.shape, name
            assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), (name, "codes")
            assert torch.equal(bits(a.scale), bits(b.scale)), (name, "scale")
        assert torch.equal(bits(dq), bits(rdq)), (name, "dq")


def test_kernel_matches_reference_quantizer_and_keeps_signed_zeros():
    x = torch.tensor([[-1e-9, 1e-9, -0.0, 0.0, 300.0, -2.0**-12] * 30])  # tiny values round to signed zeros
    got = quantize_dequantize(x, "group128")[0]
    ref = quant.dequantize(quantize_reference(x, "group128"))
    assert torch.equal(bits(got), bits(ref))
    assert torch.signbit(got[0, 0]) and not torch.signbit(got[0, 1])


def test_kernel_rejects_non_finite_like_the_torch_path():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(3, 256)
        x[1, 5] = bad
        with pytest.raises(ValueError, match="non-finite"):
            quantize_dequantize(x, "group128")
        with pytest.raises(ValueError, match="non-finite"):
            quantize_dequantize_columns(x, "rowwise")


def test_kernel_used_for_3d_inputs_and_keeps_shape():
    x = torch.randn(2, 5, 256)
    got = quantize_dequantize(x, "group128")[0]
    with torch_path():
        ref = quantize_dequantize(x, "group128")[0]
    assert got.shape == x.shape and torch.equal(bits(got), bits(ref))


def test_kernel_faster_than_torch_path_is_not_asserted_but_choice_is_reported():
    # speed is measured by bench (python -m bench), not asserted here; the choice must be stated
    assert kernels.describe().startswith("cpp fused kernel (")
    assert kernels.build_root().exists()


def test_the_kernels_run_on_torchs_threads():
    """Built with OpenMP: the kernels' parallel loops (the quantizer's, the FP8 GEMM's) run on torch's thread count.
    ATen's parallel_for opens its OpenMP region in the extension's own code, so a build without -fopenmp ran every
    kernel on one thread whatever torch.get_num_threads() said (the FP8 GEMM took as long on 2 threads as on 1)."""
    old = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert kernels.parallel_width() == n
    finally:
        torch.set_num_threads(old)


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    code = "from fp8core import kernels; print(kernels.describe())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)


@pytest.mark.slow
def test_env_switch_torch_cpp_and_bad_value():
    r = _run({kernels.ENV: "torch"})
    assert r.returncode == 0 and r.stdout.startswith("torch ops (FP8GRPO_QDQ_KERNEL=torch)"), r.stderr[-2000:]
    r = _run({kernels.ENV: "cpp"})
    assert r.returncode == 0 and r.stdout.startswith("cpp fused kernel ("), r.stderr[-2000:]
    r = _run({kernels.ENV: "fast"})
    assert r.returncode != 0 and "FP8GRPO_QDQ_KERNEL='fast' is not supported" in r.stderr


@pytest.mark.slow
def test_avx2_cap_builds_and_uses_the_avx2_variant():
    r = _run({"FP8GRPO_CPU_CAP": "avx2"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "avx2 build -mavx2 -mfma -mf16c)" in r.stdout and "avx512" not in r.stdout


@pytest.mark.slow
def test_stale_build_lock_of_a_killed_builder_is_removed():
    """torch's cpp_extension holds a ``lock`` file in the build directory while it loads (even with nothing to
    rebuild); a process SIGKILLed then leaves it behind, and torch's FileBaton made every later process wait for
    it forever. Our flock around the load knows no builder is alive and removes it."""
    stale = kernels.build_dir() / "lock"
    stale.write_text("")
    try:
        r = _run({})  # a fresh process: loads the (already built) kernel through the stale lock
        assert r.returncode == 0 and r.stdout.startswith("cpp fused kernel ("), r.stderr[-2000:]
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


@pytest.mark.slow
def test_a_failed_build_stops_python_m_fp8core(tmp_path):
    """Where the kernels should build, a failed build (here: a compiler that fails, in an empty build directory) is
    exit status 1 with the reason, so the install and CI stop; FP8GRPO_QDQ_KERNEL=torch, the one opt-out, is 0."""
    env = {"FP8GRPO_KERNEL_DIR": str(tmp_path / "kernels"), "CXX": "false"}
    r = subprocess.run([sys.executable, "-m", "fp8core"], env={**os.environ, **env}, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1].startswith("fp8core: the C++ kernels (fp8core/csrc) should build on this "
                                                        "machine and did not: torch ops (build failed ("), r.stderr
    r = subprocess.run([sys.executable, "-m", "fp8core"], env={**os.environ, **env, kernels.ENV: "torch"},
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert r.returncode == 0 and "FP8 GEMM none" in r.stdout, (r.stdout, r.stderr[-2000:])
