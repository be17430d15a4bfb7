"""The FP8 rollout engine eager and compiled, side by side in one run: engine start (compilation included), refit
time, generation tokens/s, the mismatch of its samples against the recipe's FP8 trainer (token-mult-prob-error) and
whether they equal the eager engine's bit for bit -- through the pipeline's own RolloutWorker and PolicyWorker.

    .venv/bin/python -m bench.compiled
    .venv/bin/python -m bench.compiled --recipe configs/tiny_moe_fp8_e2e.yaml --no-results-doc

Modes (``policy.generation.vllm_cfg``): ``enforce_eager: true``; ``enforce_eager: false`` with ``compile_backend:
eager`` (the model traced into one graph by TorchDynamo, run without Inductor) and with ``inductor`` (vLLM's
compilation). The FP8 layers are one op each in both compiled modes (rollout/engine_ops.py) and vLLM's own kernels
are kept, so the traced engine computes what the eager one does; Inductor fuses the BF16 parts around them
(residual adds, norms' neighbours) and may round them differently. Stamped table: docs/results/engine-compiled.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before vLLM / transformers / torchao load
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

ROOT = Path(__file__).resolve().parents[1]
MODES = {"eager": ["policy.generation.vllm_cfg.enforce_eager=true"],
         "compiled, traced only": ["policy.generation.vllm_cfg.enforce_eager=false",
                                   "policy.generation.vllm_cfg.compile_backend=eager"],
         "compiled, Inductor": ["policy.generation.vllm_cfg.enforce_eager=false",
                                "policy.generation.vllm_cfg.compile_backend=inductor"]}


def _samples(results: list[dict]) -> list:
    return [[(s["token_ids"], s["logprobs"]) for s in p["samples"]] for p in results]


def measure(recipe: str, run_dir: Path, *, prompts: int, n: int, max_tokens: int, refits: int) -> list[dict]:
    import random

    from safetensors.torch import load_file

    from configs.schema import load_config
    from diagnostics.mismatch import quick_sft_model
    from embedded.tiny_model import chat_prompt
    from process.env import apply_env
    from rewards.math_task import make_problem
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    apply_env(run_dir)
    moe = "moe" in Path(recipe).stem
    model_dir = quick_sft_model(run_dir / "models", moe=moe, steps=20 if moe else 12)
    base = [f"run_dir={run_dir}", "policy.generation.vllm_cfg.kv_cache_memory_bytes=33554432",
            "policy.generation.vllm_cfg.max_model_len=256"]
    weights = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    trainer = PolicyWorker(model_dir, load_config(recipe, base), run_dir=run_dir / "trainer")
    rows, eager = [], None
    for mode, over in MODES.items():
        engine = RolloutWorker(model_dir, load_config(recipe, base + over), run_dir=run_dir / "rollout")
        try:
            rng = random.Random(0)
            batch = [chat_prompt(engine.tokenizer, make_problem(rng)["question"]) for _ in range(prompts)]
            engine.generate(batch[:2], n=1, max_tokens=4, seed=0)  # warm-up
            engine.refit(weights)  # warm-up (first reload imports / allocates)
            refit_s = [engine.refit(weights) for _ in range(refits)]
            results = engine.generate(batch, n=n, max_tokens=max_tokens, seed=1)
            st = engine.stats()
        finally:
            engine.shutdown()
        eager = results if eager is None else eager
        rows.append({"mode": mode, "engine_start_s": st["engine_start_s"], "refit_ms": 1e3 * statistics.median(refit_s),
                     "tokens_per_s": st["last_tokens_per_s"], "tokens": st["last_generated_tokens"],
                     "mismatch": trainer.score(results)["metrics"]["mismatch/token_mult_prob_error"],
                     "same_as_eager": _samples(results) == _samples(eager)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| engine | start (s, compilation included) | refit (median ms) | generation tokens/s | "
             "token-mult-prob-error vs the FP8 trainer | samples = the eager engine's, bit for bit |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['engine_start_s']:.1f} | {r['refit_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['mismatch']:.4f} | {'yes' if r['same_as_eager'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "configs" / "tiny_fp8_e2e.yaml"), help="an FP8 recipe (tiny model)")
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "bench-compiled"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--refits", type=int, default=3)
    add_results_doc_args(p, "engine-compiled")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    for key in ("prompts", "n", "max_tokens", "refits"):
        if getattr(a, key) < 1:
            p.error(f"--{key.replace('_', '-')}: must be >= 1, got {getattr(a, key)}")
    if not Path(a.recipe).is_file():
        p.error(f"--recipe: {a.recipe} is not a file")
    origin = stamp("bench.compiled", argv)
    rows = measure(a.recipe, Path(a.run_dir), prompts=a.prompts, n=a.n, max_tokens=a.max_tokens, refits=a.refits)
    out = table(rows)
    print(out)
    doc = results_doc(a)
    if doc:
        details = [f"- recipe: `{shown(a.recipe)}` on its tiny model after a short SFT; {a.prompts} prompts x {a.n} "
                   f"samples, up to {a.max_tokens} new tokens, one batch; refit = the FP32 masters, median of "
                   f"{a.refits}",
                   "- one process, one engine at a time, in the table's order (the first start also pays the "
                   "process's first engine set-up); the trainer scores every engine's samples"]
        print(f"results: {shown(write_result('engine-compiled', 'The FP8 engine eager and compiled', out, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
