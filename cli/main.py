"""``fp8-grpo``: one command for what the project does. Each subcommand hands its arguments, unchanged, to the module
that implements it (``fp8-grpo <command> --help`` prints that module's own help).

    fp8-grpo train configs/tiny_fp8_e2e.yaml grpo.max_num_steps=5     # a training run (python -m flows.grpo)
    fp8-grpo export runs/.../checkpoints/step_000015 out/ --layout vllm
    fp8-grpo bench gemm --no-results-doc                               # a named bench; `fp8-grpo bench` the main one
    fp8-grpo experiments learning --seeds 0,1,2
    fp8-grpo stack start                                               # local Prefect + MLflow servers
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers load

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("async_grpo", "cost", "gemm", "layouts", "memory", "packing", "scaling")
EXPERIMENTS = ("learning", "recipe_table", "paper_study", "async_study")

# command -> (module whose main(argv) runs it, what it does); modules that start Prefect flows get Prefect's home
# under runs/ first (flows.cli_env), as their own ``python -m`` entry does
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flows.grpo", "train a recipe: RECIPE [key=value ...] (the fp8-grpo Prefect flow)"),
    "regression": ("flows.regression", "the nightly FP8-vs-BF16 regression with its verdict"),
    "export": ("tools.fp8_export", "the served FP8 weights of a checkpoint as a Hugging Face model directory"),
    "mismatch": ("diagnostics.mismatch", "train/inference mismatch of every recipe, through the trainer and engine"),
    "compare-val": ("tools.compare_val", "paired comparison of two runs' per-prompt validation results"),
    "warm-start": ("tools.warm_start", "build the embedded model's SFT warm start"),
    "bench": ("bench.__main__", "benchmarks: `bench` (the step against TRL) or `bench NAME` (" + ", ".join(BENCHES) + ")"),
    "experiments": ("experiments", "grids of training runs: learning, recipe_table, paper_study, async_study"),
    "stack": ("scripts/stack.py", "the local stack: Prefect server, work pool, deployments, MLflow UI"),
    "cluster": ("scripts/cluster.py", "a multi-node Ray cluster for the run's workers"),
}
PREFECT_FLOWS = ("flows.", "experiments.")
EXPERIMENTS_USAGE = ("usage: fp8-grpo experiments NAME [ARGS ...]   (fp8-grpo experiments NAME --help: its options)\n"
                     "NAME: " + ", ".join(EXPERIMENTS))


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fp8-grpo COMMAND [ARGS ...]    (fp8-grpo COMMAND --help: the command's own help)", "",
             "End-to-end FP8 RL (GRPO / DAPO) for LLMs: FP8 rollouts in vLLM and FP8 training.", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def _run_module(module: str, argv: list[str]) -> int:
    if module.startswith(PREFECT_FLOWS):
        from flows.cli_env import prefect_cli_env

        prefect_cli_env()
    if module.startswith("scripts/"):  # scripts/ is not a package: run the file with this interpreter
        return subprocess.call([sys.executable, str(ROOT / module), *argv], cwd=os.getcwd())
    rc = importlib.import_module(module).main(argv)
    return rc if isinstance(rc, int) else 0


def resolve(argv: list[str]) -> tuple[str | None, list[str], str | None]:
    """(module, its argv, error) for the command line after ``fp8-grpo``."""
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        return None, [], f"fp8-grpo: unknown command {command!r}; one of: {', '.join(COMMANDS)}"
    module = COMMANDS[command][0]
    if command == "bench" and rest and not rest[0].startswith("-"):
        name = rest[0].replace("-", "_")
        if name not in BENCHES:
            return None, [], f"fp8-grpo bench: unknown bench {rest[0]!r}; one of: {', '.join(BENCHES)}"
        return f"bench.{name}", rest[1:], None
    if command == "experiments":
        if not rest or rest[0] in ("-h", "--help"):
            return None, rest, EXPERIMENTS_USAGE
        name = rest[0].replace("-", "_")
        if name not in EXPERIMENTS:
            return None, [], f"fp8-grpo experiments: unknown experiment {rest[0]!r}; one of: {', '.join(EXPERIMENTS)}"
        return f"experiments.{name}", rest[1:], None
    if command == "export" and rest[:1] != ["export"]:  # tools.fp8_export's one subcommand: `fp8-grpo export CK OUT`
        rest = ["export", *rest]
    return module, rest, None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    module, rest, error = resolve(argv)
    if error:
        asked = error == EXPERIMENTS_USAGE and bool(rest)  # `experiments --help` (bare `experiments`: a usage error)
        print(error, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    return _run_module(module, rest)


if __name__ == "__main__":
    sys.exit(main())
