"""How the cost grows with the work: trainer step time, tokens/s and memory against model size x recipe x trainer
ranks, response length 64 vs 256, and full RL steps (rollout + train) at two sizes, in one command.

    .venv/bin/python -m bench.cost                                  # docs/results/cost.md
    .venv/bin/python -m bench.cost --sizes small,medium --no-full-steps --no-results-doc

Trainer-only rows run the pipeline's own trainer ranks on fixed rollouts (bench.memory.measure: M PolicyWorker
actors, one thread each, 4 prompts x 4 samples of 32 + 64 tokens; ``--long`` adds 256-token responses at the
medium size), for the BF16 reference recipe (configs/tiny_bf16.yaml: FP32 trainer with BF16 autocast) and end-to-end
FP8 (configs/tiny_fp8_e2e.yaml), M = 1 and 2, on the three locally built Qwen3-shaped sizes of bench.memory (2.9M,
24M, 103M parameters): the median step time of steps 2..N, trained tokens per second, the largest rank's peak above
its baseline (live tensors: freed heap returned), and per recipe the growth exponent b of time ~ params^b fitted over
the sizes (least squares in log-log). Full steps run bench.step.run_project (refit, vLLM rollout, reward, train; the
bench workload's batch, up to 64 new tokens; the untrained models sample to the length limit) at the two smaller
sizes: step time, its rollout and train parts, and the trainer / engine mismatch (token-mult-prob-error) per size.
FP8 / BF16 is given per size. Stamped table: docs/results/cost.md."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"bf16": "configs/tiny_bf16.yaml", "fp8": "configs/tiny_fp8_e2e.yaml"}
LONG = 256


def _median_step(row: dict) -> float:
    later = row["steps"][1:] or row["steps"]
    return statistics.median(s["wall_s"] for s in later)


def _long_overrides() -> list[str]:
    return [f"policy.generation.max_new_tokens={LONG}", f"policy.max_total_sequence_length={LONG + 256}",
            f"policy.generation.vllm_cfg.max_model_len={LONG + 256}"]


def trainer_rows(sizes: list[str], worlds: list[int], steps: int, out: Path, long: bool) -> list[dict]:
    from bench.memory import GENERATIONS, PROMPT_LEN, PROMPTS, RESPONSE_LEN, build_model, measure

    rows = []
    for size in sizes:
        model = build_model(size, out)
        for recipe, path in RECIPES.items():
            layouts = [(w, RESPONSE_LEN) for w in worlds] + ([(1, LONG)] if long and size == "medium" else [])
            for world, resp in layouts:
                over = _long_overrides() if resp == LONG else []
                r = measure(model, str(ROOT / path), world, steps, out, over, heap="return", response_len=resp)
                t = _median_step(r)
                tokens = PROMPTS * GENERATIONS * (PROMPT_LEN + resp)
                rows.append({"size": size, "params": r["params"], "recipe": recipe, "world": world,
                             "response_len": resp, "step_s": t, "tokens_per_s": tokens / t,
                             "peak_mb": max(r["steps"][-1]["peak_above_baseline"]) / 2 ** 20})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def full_rows(sizes: list[str], steps: int, out: Path) -> list[dict]:
    from bench.memory import build_model
    from bench.step import run_project
    from bench.workload import default_workload

    base = replace(default_workload(), max_new_tokens=64)
    rows = []
    for size in sizes:
        w = base if size == "small" else replace(base, model_dir=str(build_model(size, out)))
        for recipe, path in RECIPES.items():
            r = run_project(path, w, steps=steps)
            m = r["median"]
            rows.append({"size": size, "recipe": recipe, "step_s": m["step_s"], "rollout_s": m["rollout_s"],
                         "train_s": m["train_s"], "generated_tokens": m["generated_tokens"],
                         "mismatch": m["token_mult_prob_error"], "model": w.model_dir})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def growth_exponent(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) on log(x): y ~ x^b."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def tables(trainer: list[dict], full: list[dict]) -> str:
    from bench.memory import RESPONSE_LEN

    out = ["Trainer only (fixed rollouts; one thread per rank; median step of steps 2..N; peak = largest rank's, "
           "live tensors):", "",
           "| size | params | M | response tokens | BF16 ref: step (s) | tokens/s | peak (MB) | "
           "FP8: step (s) | tokens/s | peak (MB) | FP8 / BF16 step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    key = {(r["size"], r["world"], r["response_len"], r["recipe"]): r for r in trainer}
    for size, world, resp in dict.fromkeys((r["size"], r["world"], r["response_len"]) for r in trainer):
        b, f = key.get((size, world, resp, "bf16")), key.get((size, world, resp, "fp8"))
        if not (b and f):
            continue
        out.append(f"| {size} | {b['params'] / 1e6:.1f}M | {world} | {resp} | {b['step_s']:.2f} | "
                   f"{b['tokens_per_s']:.0f} | {b['peak_mb']:.0f} | {f['step_s']:.2f} | {f['tokens_per_s']:.0f} | "
                   f"{f['peak_mb']:.0f} | {f['step_s'] / b['step_s']:.2f}x |")
    out += ["", "Growth with model size (time ~ params^b over the sizes, response "
            f"{RESPONSE_LEN} tokens):", "", "| recipe | M | b (step time) | b (peak memory) |", "|---|---|---|---|"]
    for recipe in RECIPES:
        for world in sorted({r["world"] for r in trainer}):
            pts = [r for r in trainer if r["recipe"] == recipe and r["world"] == world
                   and r["response_len"] == RESPONSE_LEN]
            bt = growth_exponent([(r["params"], r["step_s"]) for r in pts])
            bm = growth_exponent([(r["params"], r["peak_mb"]) for r in pts])
            if bt is not None:
                out.append(f"| {recipe} | {world} | {bt:.2f} | {bm:.2f} |")
    if full:
        out += ["", "Full RL steps (refit + vLLM rollout + reward + train, in one process; median of steps 2..N):", "",
                "| size | recipe | step (s) | rollout (s) | train (s) | generated tokens | token-mult-prob-error | "
                "FP8 / BF16 step |", "|---|---|---|---|---|---|---|---|"]
        by = {(r["size"], r["recipe"]): r for r in full}
        for r in full:
            ref = by.get((r["size"], "bf16"))
            ratio = f"{r['step_s'] / ref['step_s']:.2f}x" if ref and r["recipe"] == "fp8" else "-"
            out.append(f"| {r['size']} | {r['recipe']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | "
                       f"{r['train_s']:.2f} | {r['generated_tokens']:.0f} | {r['mismatch']:.4f} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from bench.memory import SIZES, parse_worlds

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,medium,large", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--steps", type=int, default=3, help="steps per layout (medians over steps 2..N)")
    p.add_argument("--no-long", dest="long", action="store_false", help="skip the 256-token responses")
    p.add_argument("--full-sizes", default="small,medium", help="sizes of the full-step rows ('' = none)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "cost")
    add_results_doc_args(p, "cost")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    sizes = [s for s in a.sizes.split(",") if s]
    full = [s for s in a.full_sizes.split(",") if s]
    bad = [s for s in sizes + full if s not in SIZES]
    if bad or not sizes:
        p.error(f"--sizes / --full-sizes: unknown {bad or a.sizes!r}; known: {', '.join(SIZES)}")
    worlds = parse_worlds(p, a.worlds)
    if a.steps < 1:
        p.error(f"--steps: {a.steps} must be >= 1")
    import ray

    import process.quiet  # noqa: F401  third-party start-up noise off before transformers loads
    from cluster.runtime import init_ray
    from configs.schema import load_config

    origin = stamp("bench.cost", argv)
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    started = init_ray(load_config(ROOT / RECIPES["fp8"], ["ray.num_cpus=4"]), a.out / "ray")
    try:
        trainer = trainer_rows(sizes, worlds, a.steps, a.out, a.long)
    finally:
        if started:
            ray.shutdown()
    full_steps = full_rows(full, a.steps, a.out) if full else []
    body = tables(trainer, full_steps)
    print(body)
    (a.out / "latest.json").write_text(json.dumps({"trainer": trainer, "full": full_steps}, indent=1))
    doc = results_doc(a)
    if doc:
        details = ["- CPU threads: one per trainer rank (trainer-only rows); the full steps' engine and trainer share "
                   "the process's threads"]
        print(f"results: {shown(write_result('cost', 'Cost as the work grows', body, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
