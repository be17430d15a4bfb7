"""Trainer memory per data-parallel rank, measured: ``cluster.policy_workers`` = M PolicyWorker actors (the
pipeline's own, started by cluster.runtime.start_policy_workers) run ``train_step`` on the same fixed rollouts, on
locally built Qwen3-shaped models of several sizes.

    .venv/bin/python -m bench.memory                                   # sizes small,medium,large; M = 1,2
    .venv/bin/python -m bench.memory --sizes small --worlds 1,2 --no-results-doc

Per rank: the baseline is the resident set after the actor was constructed (imports, model load, sharding); each
step then runs after a peak reset (process.memory: VmHWM via /proc/self/clear_refs) and reports its peak resident
set minus that baseline -- step 1 includes creating the AdamW state, step 2 is the steady state. The table gives
the largest rank's figure and, for M > 1, its ratio to M = 1 on the same model. Precision: pages (4 KiB) of the
whole process; glibc keeps freed heap mapped (the trainer asks it to), which a peak after a reset does not count
twice. The table, stamped (commit, date, CPU, command line: tools.results), goes to docs/results/memory.md
(``--results-doc PATH``; ``--no-results-doc`` for none)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from process.memory import HEAP_ENV, HEAP_POLICIES
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

ROOT = Path(__file__).resolve().parents[1]
# Qwen3-shaped sizes at least 4x apart in parameters (FP8 blocks: hidden / MLP widths multiples of 128)
SIZES = {
    "small": {},  # the embedded model: 2.9M
    "medium": {"hidden_size": 768, "intermediate_size": 1792, "num_hidden_layers": 4, "num_attention_heads": 12,
               "num_key_value_heads": 4, "head_dim": 64},  # ~24M
    "large": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 64},  # ~103M
}
PROMPTS, GENERATIONS, PROMPT_LEN, RESPONSE_LEN = 4, 4, 32, 64
# The probe that measures the memory model's process constant: one narrow layer, so that every tensor term is a few MB
PROBE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64}


def build_model(name: str, out: Path) -> Path:
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(out / "models" / name, TinyModelSpec(**(PROBE if name == "probe" else SIZES[name])))


def predicted(model_dir: Path, recipe: str, world: int, overrides: list[str], constant: float = 0.0) -> dict:
    """trainer.memory_model's terms for this layout: the model's config.json, the bench's micro-batch, the recipe's
    FP8 and activation-checkpointing keys (the trainer's GEMMs are emulated on a CPU)."""
    from trainer.memory_model import ModelShape, predict_peak

    cfg = config(recipe, world, overrides)
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    rows = PROMPTS * GENERATIONS // world  # this rank's rows of the one update
    mbs = cfg.policy.train_micro_batch_size
    return predict_peak(shape, world=world, micro_batch_tokens=min(mbs, rows) * (PROMPT_LEN + RESPONSE_LEN),
                        micro_batches=-(-rows // mbs),
                        fp8=None if cfg.trainer_fp8_spec() is None else "emulated",
                        activation_checkpointing=cfg.policy.megatron_cfg.activation_checkpointing,
                        process_constant=constant)


def fixed_rollouts(vocab_size: int, *, seed: int = 0,
                   response_len: int = RESPONSE_LEN) -> tuple[list[dict], list[float]]:
    """PROMPTS prompts x GENERATIONS samples of fixed lengths (random token ids, rollout logprobs -0.5) and rewards
    that alternate 1 / 0 in every group (every advantage non-zero: every row trains)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rollouts, rewards = [], []
    for _ in range(PROMPTS):
        prompt = torch.randint(8, vocab_size, (PROMPT_LEN,), generator=g).tolist()
        samples = []
        for j in range(GENERATIONS):
            ids = torch.randint(8, vocab_size, (response_len,), generator=g).tolist()
            samples.append({"token_ids": ids, "logprobs": [-0.5] * len(ids), "text": ""})
            rewards.append(float(j % 2))
        rollouts.append({"prompt_token_ids": prompt, "samples": samples})
    return rollouts, rewards


def config(recipe: str, world: int, overrides: list[str]):
    from configs.schema import load_config

    batch = PROMPTS * GENERATIONS
    return load_config(recipe, [f"cluster.policy_workers={world}", f"grpo.num_prompts_per_step={PROMPTS}",
                                f"grpo.num_generations_per_prompt={GENERATIONS}",
                                f"policy.train_global_batch_size={batch}",
                                f"policy.train_micro_batch_size={batch // 2}", f"policy.logprob_batch_size={batch // 2}",
                                "policy.threads=1", "ray.policy_worker.num_cpus=0.25", *overrides])


def measure(model_dir: Path, recipe: str, world: int, steps: int, out: Path, overrides: list[str],
            heap: str = "keep", response_len: int = RESPONSE_LEN) -> dict:
    """One layout: M ranks, ``steps`` train steps; per rank the baseline RSS and each step's peak above it."""
    import ray

    from cluster.runtime import get_fail_fast, policy_refs, start_policy_workers
    from trainer.policy import PolicyWorker

    cfg = config(recipe, world, overrides)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rollouts, rewards = fixed_rollouts(vocab, response_len=response_len)
    tag = f"mem-{model_dir.name}-{world}-{int(time.time())}"

    names, handles = start_policy_workers(cfg, model_dir, out / tag, tag,
                                          env={"OMP_NUM_THREADS": "1", HEAP_ENV: heap})
    try:
        info = get_fail_fast([h.info.remote() for h in handles])
        base = get_fail_fast(policy_refs(names, PolicyWorker.memory, reset=True))
        per_step = []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            get_fail_fast(policy_refs(names, PolicyWorker.train_step, rollouts, rewards, step=step))
            wall = time.perf_counter() - t0
            mem = get_fail_fast(policy_refs(names, PolicyWorker.memory, reset=True))
            per_step.append({"step": step, "wall_s": round(wall, 2),
                             "peak_above_baseline": [m["peak"] - b["rss"] for m, b in zip(mem, base, strict=True)],
                             "rss_above_baseline": [m["rss"] - b["rss"] for m, b in zip(mem, base, strict=True)]})
        return {"model": model_dir.name, "params": info[0]["num_params"], "world": world, "heap": heap,
                "baseline_rss": [b["rss"] for b in base], "steps": per_step}
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)


def _mb(x: float) -> str:
    return f"{x / 2 ** 20:.1f}"


def _last(r: dict) -> int:
    return max(r["steps"][-1]["peak_above_baseline"])


def table(rows: list[dict]) -> str:
    """One line per (model, M): params, the largest rank's baseline and its step-1 / last-step peaks above it, the
    last step's ratio to M = 1 on the same model, and the memory model's prediction of the last step (the probe's
    rows give the model's process constant, so their prediction is their measurement)."""
    one = {r["model"]: _last(r) for r in rows if r["world"] == 1}
    lines = ["| model | params | M | baseline RSS (MB, largest rank) | step 1 peak above baseline (MB) | "
             "last step peak above baseline (MB) | last step vs M = 1 | predicted (MB) | measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        last = _last(r)
        ratio = f"{last / one[r['model']]:.2f}x" if r["world"] > 1 and one.get(r["model"]) else "-"
        pred = r.get("predicted", {}).get("total")
        if r["model"] == "probe":
            model = f"probe (constant {_mb(r['predicted']['process_constant'])})"
            cells = "- | -"
        else:
            model = r["model"]
            cells = "- | -" if pred is None else f"{_mb(pred)} | {last / pred:.2f}"
        lines.append(f"| {model} | {r['params'] / 1e6:.1f}M | {r['world']} | {_mb(max(r['baseline_rss']))} | "
                     f"{_mb(max(r['steps'][0]['peak_above_baseline']))} | {_mb(last)} | {ratio} | {cells} |")
    return "\n".join(lines)


def terms_table(rows: list[dict]) -> str:
    """The predicted terms (MB) of every measured layout (trainer.memory_model)."""
    keys = [k for k in next(iter(r["predicted"] for r in rows if "predicted" in r)) if k != "total"]
    lines = ["| model | M | " + " | ".join(k.replace("_", " ") for k in keys) + " | total | measured |",
             "|---|---|" + "---|" * (len(keys) + 2)]
    for r in rows:
        if r["model"] == "probe" or "predicted" not in r:
            continue
        p = r["predicted"]
        lines.append(f"| {r['model']} | {r['world']} | " + " | ".join(_mb(p[k]) for k in keys) +
                     f" | {_mb(p['total'])} | {_mb(_last(r))} |")
    return "\n".join(lines)


HEAP_NOTE = {"keep": "freed heap kept mapped, as the trainer runs: the peak includes what earlier steps left",
             "return": "freed blocks of 128 KiB and more unmapped: the peak follows the live tensors"}
NOTE = ("What is measured and how to read it: [performance](../performance.md#trainer-memory). Trainer-only: "
        "`train_step` on fixed rollouts, no engine.")


def parse_worlds(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--worlds``: comma-separated numbers of data-parallel ranks, each >= 1 (else the parser's one-line error)."""
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        parser.error(f"--worlds: {text!r} is not a comma-separated list of integers")
    if any(w < 1 for w in worlds):
        parser.error(f"--worlds: {text!r}: every number of ranks must be >= 1")
    return worlds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,medium,large", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--worlds", default="1,2", help="comma-separated numbers of data-parallel ranks")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--recipe", default="configs/tiny_fp8_e2e.yaml")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "memory")
    p.add_argument("--heap", choices=tuple(HEAP_POLICIES), default="keep",
                   help="glibc in the ranks: keep freed heap mapped (the trainer's setting) or return it, so the "
                        "peak is the live tensors' (slower)")
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value) for every layout")
    add_results_doc_args(p, "memory")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    sizes = [s for s in a.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        p.error(f"--sizes: unknown {bad or a.sizes!r}; known: {', '.join(SIZES)}")
    worlds = parse_worlds(p, a.worlds)
    if a.steps < 1:
        p.error(f"--steps: {a.steps} must be >= 1")
    import process.quiet  # noqa: F401  third-party start-up noise off before transformers loads
    origin = stamp("bench.memory", argv)
    try:  # a bad recipe or override fails here, in one line, before any model is built
        config(a.recipe, 1, a.overrides)
    except (ValueError, OSError) as e:
        p.error(str(e).splitlines()[0])
    import ray

    from cluster.runtime import init_ray
    from configs.schema import load_config

    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    models = {s: build_model(s, a.out) for s in ["probe", *sizes]}
    started = init_ray(load_config(a.recipe, ["ray.num_cpus=4"]), a.out / "ray")
    rows, constant = [], {}
    try:
        for w in worlds:  # the process constant per M: the probe's peak beyond its (few MB of) tensor terms
            r = measure(models["probe"], a.recipe, w, a.steps, a.out, a.overrides, a.heap)
            constant[w] = _last(r) - predicted(models["probe"], a.recipe, w, a.overrides)["total"]
            r["predicted"] = predicted(models["probe"], a.recipe, w, a.overrides, constant[w])
            rows.append(r)
            print(json.dumps(r), flush=True)
        for s in sizes:
            for w in worlds:
                r = measure(models[s], a.recipe, w, a.steps, a.out, a.overrides, a.heap)
                r["predicted"] = predicted(models[s], a.recipe, w, a.overrides, constant[w])
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if started:
            ray.shutdown()
    print(table(rows))
    print(terms_table(rows))
    (a.out / "latest.json").write_text(json.dumps(rows, indent=1))
    doc = results_doc(a)
    if doc:
        details = [f"- workload: `{a.recipe}`, {PROMPTS} prompts x {GENERATIONS} samples, {PROMPT_LEN} + "
                   f"{RESPONSE_LEN} tokens, micro-batch {PROMPTS * GENERATIONS // 2}, {a.steps} steps; runs under "
                   f"`{shown(a.out)}`",
                   f"- heap: `{a.heap}` ({HEAP_NOTE[a.heap]})" + (f"; overrides: `{' '.join(a.overrides)}`"
                                                                if a.overrides else "")]
        body = f"{table(rows)}\n\nThe predicted terms (MB; trainer.memory_model):\n\n{terms_table(rows)}"
        path = write_result("memory", "Trainer memory per rank", body, origin, note=NOTE, details=details, path=doc)
        print(f"results: {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
