"""Every command-line entry point imports process.quiet before torch / transformers / torchao load, so a start prints
none of torchao's ``Failed to load ..._C*.so`` lines and none of torch's pytree ``register_constant()`` deprecation
warnings -- while the project's own warnings and log lines still print.

``--help`` shows what a user sees first. ``import <entry>; import transformers.modeling_utils`` is the real trigger:
it loads torchao, as a model load does a moment later in each command; without process.quiet it prints four lines."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("torchao", "pytree", "Warning", "Failed to load", "register_constant()")
# the switches process.quiet sets; stripped so a subprocess starts as a user's shell does
QUIET_ENV = ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
ENTRY_MODULES = ["flows.grpo", "flows.regression", "tools.fp8_export", "tools.compare_val", "tools.warm_start",
                 "bench.__main__", "bench.engine", "experiments.learning", "experiments.paper_study",
                 "experiments.recipe_table", "experiments.async_study", "cli.main", "diagnostics.mismatch", "diagnostics.moe_mismatch",
                 "diagnostics.kv_attribution"]
ENTRY_SCRIPTS = ["scripts/stack.py", "scripts/cluster.py"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _noise(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if any(n in ln for n in NOISE)]


@pytest.mark.parametrize("module", ["flows.grpo", "tools.fp8_export", "tools.compare_val"])
def test_help_prints_usage_and_no_third_party_noise(module):
    out = _run([sys.executable, "-m", module, "--help"])
    assert out.returncode == 0 and f"python -m {module}" in out.stdout, out.stderr[-2000:]
    assert not _noise(out.stderr), out.stderr


def _load_after(import_entry: str) -> subprocess.CompletedProcess:
    code = (f"{import_entry}\n"
            "import transformers.modeling_utils  # loads torchao, as a model load does\n"
            "import logging, warnings\n"
            "logging.getLogger('fp8core').warning('our logger line')\n"
            "warnings.warn('our warning')\n")
    return _run([sys.executable, "-c", code])


def _assert_quiet_but_ours_print(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stderr[-2000:]
    assert "our logger line" in out.stderr and "UserWarning: our warning" in out.stderr, out.stderr
    assert not [ln for ln in _noise(out.stderr) if "our warning" not in ln], out.stderr


def test_the_noise_exists_without_cluster_quiet():
    """The checks here can fail: the same load with no entry point imported first prints torchao's and pytree's lines."""
    out = _run([sys.executable, "-c", "import transformers.modeling_utils"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert any("torchao" in ln for ln in out.stderr.splitlines()), out.stderr
    assert any("register_constant()" in ln for ln in out.stderr.splitlines()), out.stderr


def test_a_model_library_loads_quietly_after_the_export_entry_point():
    _assert_quiet_but_ours_print(_load_after("import tools.fp8_export"))


@pytest.mark.slow
@pytest.mark.parametrize("module", ENTRY_MODULES)
def test_a_model_library_loads_quietly_after_each_entry_module(module):
    _assert_quiet_but_ours_print(_load_after(f"import {module}"))


@pytest.mark.slow
@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_a_model_library_loads_quietly_after_each_entry_script(script):
    # the scripts are run as files (their folder is not a package): load them the same way, under another name
    load = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('entry_script', {str(ROOT / script)!r})\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))")
    _assert_quiet_but_ours_print(_load_after(load))
