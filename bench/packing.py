"""Sequence packing, measured: the trainer's step (PolicyWorker.train_step) with padded batches and with packed ones
(policy.sequence_packing), side by side on the same rollouts.

    .venv/bin/python -m bench.packing                        # the embedded default's task and warm start, 6 steps
    .venv/bin/python -m bench.packing --task arithmetic --steps 3 --no-results-doc

The rollouts come from the pipeline's own vLLM engine (RolloutWorker.generate) on the bench workload's batch
(bench.workload: 16 prompts x 8 samples, 2 updates of 2 micro-batches per step) with the embedded ``--task``'s
prompts and SFT warm start (``addition``, the default run's: scratchpad responses of spread lengths; ``arithmetic``,
the bench's: ~20 tokens each) and up to ``--max-new-tokens`` (default 128), sampled once per step with the initial
weights. Two trainers (padded, packed) each train on every step's rollouts, in alternating
order; per step: train_step's wall time and ``train/padding_frac`` (the share of the positions the step's forwards
computed that were padding). Medians over steps 2..N; the ratio packed / padded. Table, stamped:
docs/results/packing.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.workload import ROOT, default_workload, reward, step_rows
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

PACKED = "policy.sequence_packing.enabled=true"


def workload(task: str, max_new_tokens: int):
    """The bench's batch on ``task``'s embedded assets (built when missing) and that task's reward."""
    from bench.workload import Workload
    from embedded.bootstrap import ensure_default_assets
    from rewards.registry import get_task

    if task == "arithmetic":
        return replace(default_workload(), max_new_tokens=max_new_tokens), reward
    a = ensure_default_assets(ROOT / "runs" / "assets", task=task)
    return Workload(model_dir=str(a["model_dir"]), train_path=str(a["train"]),
                    max_new_tokens=max_new_tokens), get_task(task).reward


def spread_lengths(outs: list[dict], seed: int) -> None:
    """``--spread``: cut every response to a uniformly drawn 1..its length tokens (its logprobs with it), in place --
    the long tail of lengths RL on reasoning models produces, which the embedded tasks' near-equal responses lack.
    Synthetic: the trainer trains on the cut responses as given."""
    import random

    rng = random.Random(seed)
    for o in outs:
        for s in o["samples"]:
            n = rng.randint(1, len(s["token_ids"])) if s["token_ids"] else 0
            s["token_ids"], s["logprobs"] = s["token_ids"][:n], s["logprobs"][:n]


def measure(recipe: str, steps: int, max_new_tokens: int, task: str, overrides: list[str],
            spread: bool = False) -> dict:
    from bench.step import recipe_overrides
    from configs.schema import load_config
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    w, score = workload(task, max_new_tokens)
    base = [*recipe_overrides(w), f"policy.max_total_sequence_length={max_new_tokens + 128}",
            f"policy.generation.vllm_cfg.max_model_len={max_new_tokens + 128}", *overrides]
    cfg = {name: load_config(ROOT / recipe, base + extra) for name, extra in (("padded", []), ("packed", [PACKED]))}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-packing-", dir=ROOT / "runs"))
    engine = RolloutWorker(w.model_dir, cfg["padded"], run_dir=run_dir / "rollout")
    trainers = {name: PolicyWorker(w.model_dir, c, run_dir=run_dir / name) for name, c in cfg.items()}
    gen = cfg["padded"].policy.generation
    per_step = []
    try:
        _steps(w, steps, engine, trainers, gen, per_step, task, score, spread)
    finally:
        engine.shutdown()
    later = per_step[1:] or per_step
    med = {k: statistics.median(r[k] for r in later) for k in later[0] if k != "step"}
    return {"recipe": recipe, "workload": w, "per_step": per_step, "median": med}


def _steps(w, steps: int, engine, trainers: dict, gen, per_step: list, task: str, score, spread: bool) -> None:
    from embedded.tiny_model import chat_prompt
    from tasks.rl import rollout_seed

    for step in range(1, steps + 1):
        rows = step_rows(w, step - 1)
        prompts = [chat_prompt(trainers["padded"].tokenizer, r["question"], task) for r in rows]
        outs = engine.generate(prompts, n=w.num_generations, max_tokens=gen.max_new_tokens,
                               temperature=gen.temperature, top_p=gen.top_p, seed=rollout_seed(w.seed, step))
        rewards = [float(score(s["text"], r["answer"])) for r, o in zip(rows, outs, strict=True)
                   for s in o["samples"]]
        if spread:
            spread_lengths(outs, step)
        lengths = [len(s["token_ids"]) for o in outs for s in o["samples"]]
        row = {"step": step, "response_tokens_mean": statistics.mean(lengths), "response_tokens_max": max(lengths)}
        order = ("padded", "packed") if step % 2 else ("packed", "padded")
        for name in order:
            t0 = time.perf_counter()
            m = trainers[name].train_step(outs, rewards, step=step)
            row[f"{name}_s"] = time.perf_counter() - t0
            row[f"{name}_padding_frac"] = m["train/padding_frac"]
        per_step.append(row)
        print(row, flush=True)


def table(results: list[dict]) -> str:
    lines = ["| recipe | response tokens (mean / max) | padding share, padded | padding share, packed | "
             "train step, padded (s) | train step, packed (s) | packed / padded |", "|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        lines.append(f"| `{r['recipe']}` | {m['response_tokens_mean']:.0f} / {m['response_tokens_max']:.0f} | "
                     f"{m['padded_padding_frac']:.1%} | {m['packed_padding_frac']:.1%} | {m['padded_s']:.2f} | "
                     f"{m['packed_s']:.2f} | {m['packed_s'] / m['padded_s']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="configs/tiny_bf16.yaml,configs/tiny_fp8_e2e.yaml")
    p.add_argument("--steps", type=int, default=6, help="steps per recipe (medians over steps 2..N)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--task", choices=("addition", "arithmetic"), default="addition",
                   help="the embedded task whose prompts and warm start the rollouts use")
    p.add_argument("--spread", action="store_true",
                   help="cut each response to a random length (synthetic: a long tail of lengths)")
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value) for both sides")
    add_results_doc_args(p, "packing")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.steps < 1 or a.max_new_tokens < 1:
        p.error("--steps and --max-new-tokens must be >= 1")
    recipes = [r for r in a.recipes.split(",") if r]
    from configs.schema import load_config

    for r in recipes:  # a bad recipe or override fails here, in one line, before any model loads
        try:
            load_config(ROOT / r, [*a.overrides, PACKED])
        except (ValueError, OSError) as e:
            p.error(f"{r}: {str(e).splitlines()[0]}")
    import process.quiet  # noqa: F401  third-party start-up noise off before transformers loads
    origin = stamp("bench.packing", argv)
    results = [measure(r, a.steps, a.max_new_tokens, a.task, a.overrides, a.spread) for r in recipes]
    out = table(results)
    print(out)
    doc = results_doc(a)
    if doc:
        w = results[0]["workload"]
        details = [f"- workload: embedded task `{a.task}`{' (responses cut to random lengths: --spread)' if a.spread else ''}, {w.num_prompts} prompts x {w.num_generations} samples, up to "
                   f"{w.max_new_tokens} new "
                   f"tokens, global batch {w.global_batch}, micro-batch {w.micro_batch} rows (packed: the same "
                   f"number of tokens), {a.steps} steps, medians of steps 2..{a.steps}; trainer only (train_step)"]
        print(f"results: {shown(write_result('packing', 'Sequence packing', out, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
