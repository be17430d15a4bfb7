"""Where the FP8 KV cache's train/inference mismatch comes from: K rounding, V rounding, or saturation.

With ``kv_cache_dtype: fp8`` the rollout engine rounds every K and V through E4M3 with the per-layer scales the
trainer calibrated (rollout/engine.py ``round_kv_through_e4m3``), while the trainer's attention stays in high
precision (the method: attention is not FP8 in training). This tool samples with the FP8-KV engine and recomputes
the sampled tokens' logprobs with the FP8 trainer four ways: as trained, with K rounded like the engine, with V
rounded, with both (``kv_rounding``: a transformers attention implementation that rounds the post-RoPE key and
the value with the layer's scales, then runs the model's own attention), and as a reference the trainer against the engine without the
FP8 KV cache (the calibration rollout below). The mismatch that disappears when the trainer rounds K is K's
rounding error; what stays is the rest (BF16 vs FP32 activations, engine kernels). It also reports saturation: the
share of K / V elements of real tokens beyond ``448 * scale`` (clamped by the cache).

The scales are calibrated as the pipeline does at refit (fp8core.rl.kv_calibration on the FP8 trainer, from
prompts + responses of an FP8 rollout of the same prompts with another seed)::

    .venv/bin/python -m diagnostics.kv_attribution --model-dir <checkpoint dir> [--data <jsonl with "question">]
        [--prompts 128] [--n 8] [--max-tokens 64] [--seed 2] [--fp8-recipe blockwise]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from cluster.env import apply_env
from configs.schema import standalone_engine_config
from diagnostics.mismatch import (
    calibrate_kv_scales,
    flatten_results,
    load_trainer_model,
    mismatch,
    trainer_logprobs,
)
from fp8core.linear import RECIPES
from rollout.engine import RolloutWorker
from trainer.kv_rounding import _Saturation, kv_rounding

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "(engine without FP8 KV cache, same prompts, other seed)"
SETTINGS = {"as trained (high-precision attention)": (False, False), "K rounded like the engine": (True, False),
            "V rounded like the engine": (False, True), "K and V rounded": (True, True)}


def attribution(model_dir: str | Path, prompts: list[str], *, run_dir: Path, n: int = 8, max_tokens: int = 64,
                seed: int = 2, base: dict | None = None) -> dict:
    """The four trainer settings' mismatch against one FP8-KV rollout, with the scales and the saturation."""
    model_dir = Path(model_dir)
    base = {**(base if base is not None else dict(max_model_len=160, kv_cache_memory_bytes=64 << 20)),
            "precision": "fp8"}  # policy.generation.vllm_cfg keys
    engine_cfg = standalone_engine_config(seed=seed, kv_cache_dtype="auto", **base)
    spec = engine_cfg.rollout_fp8_spec()
    trainer = load_trainer_model(model_dir, fp8=True, dtype=torch.float32, recipe=spec.recipe,
                                 num_first_layers_in_bf16=spec.num_first_layers_in_bf16,
                                 num_last_layers_in_bf16=spec.num_last_layers_in_bf16,
                                 pow2_weight=spec.pow2_weight, pow2_activation=spec.pow2_activation)
    worker = RolloutWorker(model_dir, engine_cfg, run_dir=run_dir)
    try:  # the calibration sequences: an FP8 rollout of the same prompts, as the previous step's would be
        calib = flatten_results(worker.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed))
    finally:
        worker.shutdown()
    scales = calibrate_kv_scales(trainer, calib[0], calib[1], batch_size=64)
    worker = RolloutWorker(model_dir, standalone_engine_config(seed=seed, kv_cache_dtype="fp8", **base), run_dir=run_dir)
    try:
        worker.set_kv_scales(scales)
        results = worker.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed + 1)
        kv_mode = worker.stats()["kv_mode"]
    finally:
        worker.shutdown()
    ps, rs, lps = flatten_results(results)
    # the reference: the same trainer against the engine without the FP8 KV cache (the calibration rollout)
    rows = {REFERENCE: mismatch(trainer_logprobs(trainer, calib[0], calib[1], batch_size=64), calib[2])}
    sat = _Saturation()  # counted in the first setting's forwards (as trained: K / V not rounded upstream)
    for i, (label, (rk, rv)) in enumerate(SETTINGS.items()):
        with kv_rounding(trainer, scales, round_k=rk, round_v=rv, saturation=sat if i == 0 else None):
            rows[label] = mismatch(trainer_logprobs(trainer, ps, rs, batch_size=64), lps)
    return {"rows": rows, "kv_scales": scales, "saturation": sat.fractions(), "kv_mode": kv_mode,
            "sequences": len(ps), "model_dir": str(model_dir)}


def format_attribution(table: dict) -> str:
    lines = ["| trainer attention | token_mult_prob_error | kl_k3(train‖rollout) | max abs Δlogp | tokens with "
             "abs Δlogp > 1 | share of the excess they carry |", "|---|---|---|---|---|---|"]
    for label, m in table["rows"].items():
        lines.append(f"| {label} | {m['mismatch/token_mult_prob_error']:.4f} | "
                     f"{m['mismatch/kl_k3_train_rollout']:.2e} | {m['mismatch/max_abs_logp_diff']:.2f} | "
                     f"{m['mismatch/frac_abs_logp_diff_gt_1']:.3%} | "
                     f"{m['mismatch/excess_share_abs_logp_diff_gt_1']:.0%} |")
    sat = table["saturation"]
    lines.append("")
    lines.append(f"{table['sequences']} sequences, {table['rows'][next(iter(SETTINGS))]['tokens']} tokens (reference: "
                 f"{table['rows'][REFERENCE]['tokens']}); engine KV "
                 f"cache {table['kv_mode']}; saturated (|x| > 448 * scale) K {sat['k']:.2e}, V {sat['v']:.2e} of "
                 f"the real tokens' elements")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="an HF checkpoint dir (e.g. <run_dir>/checkpoints/step_N)")
    ap.add_argument("--data", default=str(ROOT / "runs" / "assets" / "addition" / "data" / "train.jsonl"),
                    help="JSONL with a 'question' field per line (default: the embedded task's RL prompts)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "kv-attribution"))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--fp8-recipe", default="blockwise", choices=RECIPES,
                    help="the checkpoint's FP8 recipe (engine and trainer run the same one)")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    model_dir, data = Path(args.model_dir), Path(args.data)
    for what, path in (("--model-dir", model_dir / "config.json"), ("--data", data)):
        if not path.is_file():
            raise SystemExit(f"{what}: {path} does not exist")
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    if not rows or any("question" not in r for r in rows):
        raise SystemExit(f"--data: {data} needs a 'question' field on every line")
    run_dir = Path(args.run_dir)
    apply_env(run_dir)
    from transformers import AutoTokenizer

    from embedded.tiny_model import chat_prompt

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    random.Random(args.seed).shuffle(rows)
    prompts = [chat_prompt(tok, r["question"]) for r in rows[:args.prompts]]
    t0 = time.perf_counter()
    base = dict(fp8_recipe=args.fp8_recipe, max_model_len=160, kv_cache_memory_bytes=64 << 20)
    table = attribution(model_dir, prompts, run_dir=run_dir, n=args.n, max_tokens=args.max_tokens, seed=args.seed,
                        base=base)
    print(f"model: {model_dir}; {len(prompts)} prompts x n={args.n}, max_tokens={args.max_tokens}, T=1, "
          f"seed {args.seed}, FP8 {args.fp8_recipe}")
    print(format_attribution(table))
    print(f"(computed in {time.perf_counter() - t0:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
