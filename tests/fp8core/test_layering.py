"""fp8core stays pure torch + numpy: importing any of its modules pulls in none of the orchestration / serving stack."""
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import fp8core

FORBIDDEN = ("prefect", "ray", "vllm", "mlflow", "s3fs", "transformer_engine")


def _all_modules() -> list[str]:
    root = Path(fp8core.__file__).parent
    return ["fp8core"] + sorted(m.name for m in pkgutil.walk_packages([str(root)], prefix="fp8core."))


def test_walk_finds_the_numerics_modules():
    mods = _all_modules()
    assert {"fp8core.quant", "fp8core.linear", "fp8core.convert"} <= set(mods)


def test_fp8core_imports_no_forbidden_package():
    mods = _all_modules()
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(k for k in sys.modules if k.split('.')[0] in {FORBIDDEN!r})\n"
        "print(json.dumps(bad))\n"
    )
    root = Path(fp8core.__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    bad = json.loads(out.stdout.strip().splitlines()[-1])
    assert bad == [], f"fp8core modules {mods} pulled in {bad}"


def test_detector_catches_a_forbidden_import():
    """The check above can fail: the same probe sees a forbidden package when one is imported."""
    code = f"import json, sys, mlflow\nprint(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {FORBIDDEN!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mlflow" in json.loads(out.stdout.strip().splitlines()[-1])
