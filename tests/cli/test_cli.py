"""The ``fp8-grpo`` console script: its help lists every command, each command reaches its module (whose own help it
prints), and bad commands or input stop with one line and exit status 2."""
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import BENCHES, COMMANDS, EXPERIMENTS, resolve

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("fp8-grpo")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_console_script_is_installed_and_lists_the_commands():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        assert f"\n  {name} " in r.stdout, name
    assert _run().returncode == 2


@pytest.mark.parametrize("args, module, rest", [
    (["train", "configs/tiny_fp8_e2e.yaml", "grpo.max_num_steps=2"], "flows.grpo",
     ["configs/tiny_fp8_e2e.yaml", "grpo.max_num_steps=2"]),
    (["bench"], "bench.__main__", []),
    (["bench", "--steps", "3"], "bench.__main__", ["--steps", "3"]),
    (["bench", "async-grpo", "--steps", "4"], "bench.async_grpo", ["--steps", "4"]),
    (["experiments", "paper-study", "--table-only"], "experiments.paper_study", ["--table-only"]),
    (["stack", "start"], "scripts/stack.py", ["start"]),
    (["export", "CK", "OUT", "--eval"], "tools.fp8_export", ["export", "CK", "OUT", "--eval"]),
    (["export", "export", "CK", "OUT"], "tools.fp8_export", ["export", "CK", "OUT"]),
])
def test_commands_reach_their_module_with_the_arguments_unchanged(args, module, rest):
    assert resolve(args) == (module, rest, None)


def test_every_bench_and_experiment_name_is_a_module_with_main():
    import importlib

    for name in BENCHES:
        assert callable(importlib.import_module(f"bench.{name}").main), name
    for name in EXPERIMENTS:
        assert callable(importlib.import_module(f"experiments.{name}").main), name


@pytest.mark.parametrize("args, needle", [(["nope"], "unknown command 'nope'"), (["bench", "nope"], "unknown bench"),
                                          (["experiments", "nope"], "unknown experiment"),
                                          (["experiments"], "usage: fp8-grpo experiments NAME")])
def test_bad_commands_fail_with_one_line(args, needle):
    r = _run(*args)
    assert r.returncode == 2 and needle in r.stderr and r.stdout == "", (r.stdout, r.stderr)


@pytest.mark.parametrize("args, needle", [(["train", "--help"], "python -m flows.grpo"),
                                          (["bench", "gemm", "--help"], "--shapes"),
                                          (["experiments", "async_study", "--help"], "--age"),
                                          (["stack", "--help"], "scripts/stack"),
                                          (["export", "--help"], "--eval-prompts")])
def test_help_of_a_command_is_its_modules_help(args, needle):
    r = _run(*args)
    assert r.returncode == 0 and needle in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])


def test_train_rejects_a_bad_key_before_any_work(tmp_path):
    r = _run("train", "configs/tiny_fp8_e2e.yaml", "policy.optimizer.lr=-1", f"run_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("config error: policy.optimizer.lr:")
    assert not (tmp_path / "run").exists()
