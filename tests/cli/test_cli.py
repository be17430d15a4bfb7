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


# Bad input through `fp8-grpo train`, as a new user would type it: each case stops with exit status 2 and one line on
# stderr naming the file (and line) or the dotted key, before Prefect, Ray or any worker starts. The cases call the
# console script's own main() with the command line (the script itself is run above and for the data row below:
# a process each would add ~2.5 s per case for the same code path).
BAD_RECIPE_CASES = {
    "yaml syntax": ([], r"^config error: .*broken\.yaml:3:7: not valid YAML: "),
    "directory as recipe": (None, r"^config error: .*: is a directory, not a recipe file"),
    "betas": (["policy.optimizer.betas=[1.5,0.999]"], r"^config error: policy\.optimizer\.betas\[0\]: must be in \[0, 1\)"),
    "weight decay nan": (["policy.optimizer.weight_decay=.nan"],
                         r"^config error: policy\.optimizer\.weight_decay: must be a finite number, got nan$"),
    "weight decay nan text": (["policy.optimizer.weight_decay=nan"],
                              r"^config error: policy\.optimizer\.weight_decay: must be a finite number, got nan$"),
    "eps zero": (["policy.optimizer.eps=0"], r"^config error: policy\.optimizer\.eps: must be > 0"),
    "eps nan": (["policy.optimizer.eps=.nan"], r"^config error: policy\.optimizer\.eps: must be a finite number"),
    "negative warmup": (["policy.scheduler.warmup_steps=-1"],
                        r"^config error: policy\.scheduler\.warmup_steps: must be >= 0"),
    "infinite lr": (["policy.optimizer.lr=.inf"], r"^config error: policy\.optimizer\.lr: must be a finite number"),
    "override not yaml": (["grpo.seed=[1"], r"^config error: grpo\.seed: the override's value '\[1' is not valid YAML"),
    "missing model dir": (["policy.model_name=/nonexistent/model"],
                          r"^config error: policy\.model_name: /nonexistent/model is neither a local Hugging Face "
                          r"model directory nor a hub id"),
}


@pytest.mark.parametrize("case", list(BAD_RECIPE_CASES))
def test_train_rejects_bad_input_in_one_line_before_any_work(case, tmp_path, capsys):
    import re

    from cli.main import main

    overrides, pattern = BAD_RECIPE_CASES[case]
    if overrides is None:  # the recipe argument is a directory
        recipe = tmp_path
        overrides = []
    elif case == "yaml syntax":
        recipe = tmp_path / "broken.yaml"
        recipe.write_text("grpo:\n  max_num_steps: [1\n  seed: 0\n")
    else:
        recipe = ROOT / "configs" / "tiny_fp8_e2e.yaml"
    run_dir = tmp_path / "run"
    rc = main(["train", str(recipe), *overrides, f"run_dir={run_dir}"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and re.search(pattern, lines[0]), (rc, err[-3000:])
    assert out == "" and not run_dir.exists()  # nothing started: no run header, no run directory


def test_train_rejects_a_data_row_whose_answer_is_not_text_naming_the_line(tmp_path):
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                             TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": ["4"]}\n')
    run_dir = tmp_path / "run"
    r = _run("train", "configs/tiny_fp8_e2e.yaml", f"policy.model_name={model}", f"data.train_path={rows}",
             f"data.validation_path={rows}", f"run_dir={run_dir}", "logger.mlflow_enabled=false")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines == [f"data error: {rows}:2: answer key 'answer' is a list ([\"4\"]); expected "
                                           "text or a number"], r.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() and "step 1/" not in r.stdout
