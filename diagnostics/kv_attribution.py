"""Where the FP8 KV cache's train/inference mismatch comes from: K rounding, V rounding, or saturation.

With ``kv_cache_dtype: fp8`` the rollout engine rounds every K and V through E4M3 with the per-layer scales the
trainer calibrated (rollout/emulation.py ``round_kv_through_e4m3``), while the trainer's attention stays in high
precision (the method: attention is not FP8 in training). This tool builds engine and trainer from one recipe
(default configs/tiny_fp8_e2e_kv.yaml; ``--set`` overrides), samples with its FP8-KV engine and scores the sampled
tokens with the recipe's trainer (``PolicyWorker.score``) four ways:

* as trained (``calibration.kv_rounding_in_trainer: false``: high-precision attention);
* K and V rounded like the engine (``calibration.kv_rounding_in_trainer: true``: the trainer's own replay of the
  engine's cache with the scales it calibrated);
* K rounded only / V rounded only: not a trainer setting (the replay rounds both), so the as-trained trainer scores
  inside ``trainer.kv_rounding.kv_rounding(policy.model, scales, round_k=..., round_v=...)``, the attention
  implementation the replay installs, with one of the two roundings;

and as a reference the trainer against the engine without the FP8 KV cache (the calibration rollout below). The
mismatch that disappears when the trainer rounds K is K's rounding error; what stays is the rest (BF16 vs FP32
activations, engine kernels). It also reports saturation: the share of K / V elements of real tokens beyond
``448 * scale`` (clamped by the cache), counted in a separate scoring pass.

The scales are calibrated as the pipeline does at refit (``PolicyWorker.calibrate_kv_scales`` on
``calibration.kv_calibration_samples`` prompts + responses of an FP8 rollout of the same prompts without the FP8 KV
cache, seed ``--seed``); the FP8-KV rollout uses seed ``--seed + 1``::

    .venv/bin/python -m diagnostics.kv_attribution --model-dir <checkpoint dir> [--data <jsonl with "question">]
        [--prompts 128] [--n 8] [--seed 2] [--fp8-recipe blockwise] [--recipe configs/tiny_fp8_e2e_kv.yaml]
        [--set calibration.kv_calibration_samples=1024]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / vLLM load
from configs.schema import Config, config_from_dict, load_config
from diagnostics.mismatch import ROOT, fp8_overrides, sample, without_fp8_kv
from fp8core.linear import RECIPES
from process.env import apply_env
from trainer.kv_rounding import _Saturation, kv_rounding

REFERENCE = "(engine without FP8 KV cache, same prompts, other seed)"
AS_TRAINED = "as trained (high-precision attention)"
K_ONLY, V_ONLY = "K rounded like the engine", "V rounded like the engine"
BOTH = "K and V rounded (calibration.kv_rounding_in_trainer)"
SETTINGS = {AS_TRAINED: (False, False), K_ONLY: (True, False), V_ONLY: (False, True), BOTH: (True, True)}


def with_kv_rounding(cfg: Config, on: bool) -> Config:
    return config_from_dict(cfg.to_dict(), [f"calibration.kv_rounding_in_trainer={str(on).lower()}"])


def attribution(model_dir: str | Path, prompts: list[str], cfg: Config, *, run_dir: Path, n: int = 8,
                seed: int = 2) -> dict:
    """The four trainer settings' mismatch against one FP8-KV rollout of ``cfg``'s engine, with the reference, the
    scales and the saturation."""
    from trainer.policy import PolicyWorker

    model_dir = Path(model_dir)
    if not cfg.policy.generation.vllm_cfg.kv_fp8:
        raise ValueError("kv_attribution needs a recipe with policy.generation.vllm_cfg.kv_cache_dtype=fp8")
    trained = PolicyWorker(model_dir, with_kv_rounding(cfg, False), run_dir=run_dir)
    replay = PolicyWorker(model_dir, with_kv_rounding(cfg, True), run_dir=run_dir)
    # the calibration sequences: an FP8 rollout of the same prompts without the FP8 KV cache (the previous step's)
    calib, _ = sample(model_dir, without_fp8_kv(cfg), prompts, n=n, seed=seed, run_dir=run_dir / "calibration")
    k = cfg.calibration.kv_calibration_samples
    scales = trained.calibrate_kv_scales(calib, max_samples=k)
    if replay.calibrate_kv_scales(calib, max_samples=k) != scales:  # the replaying trainer rounds with its own
        raise RuntimeError("the two trainers calibrated different K/V scales on the same sequences")
    results, stats = sample(model_dir, cfg, prompts, n=n, seed=seed + 1, run_dir=run_dir / "rollout",
                            kv_scales=scales)
    per_layer = {k: v for k, v in scales.items() if k != "version"}
    rows = {REFERENCE: trained.score(calib)["metrics"], AS_TRAINED: trained.score(results)["metrics"]}
    for label in (K_ONLY, V_ONLY):
        rk, rv = SETTINGS[label]
        with kv_rounding(trained.model, per_layer, round_k=rk, round_v=rv):
            rows[label] = trained.score(results)["metrics"]
    rows[BOTH] = replay.score(results)["metrics"]
    sat = _Saturation()  # K / V as trained (not rounded upstream), real tokens only
    with kv_rounding(trained.model, per_layer, round_k=False, round_v=False, saturation=sat):
        trained.score(results)
    return {"rows": {label: rows[label] for label in (REFERENCE, *SETTINGS)}, "kv_scales": scales,
            "saturation": sat.fractions(), "kv_mode": stats["kv_mode"],
            "sequences": sum(len(r["samples"]) for r in results), "model_dir": str(model_dir),
            "recipe": cfg.recipe}


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
    lines.append(f"{table['sequences']} sequences, {table['rows'][AS_TRAINED]['tokens']} tokens (reference: "
                 f"{table['rows'][REFERENCE]['tokens']}); engine KV "
                 f"cache {table['kv_mode']}; saturated (|x| > 448 * scale) K {sat['k']:.2e}, V {sat['v']:.2e} of "
                 f"the real tokens' elements")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="an HF checkpoint dir (e.g. <run_dir>/checkpoints/step_N)")
    ap.add_argument("--data", default=str(ROOT / "runs" / "assets" / "addition" / "data" / "train.jsonl"),
                    help="JSONL with a 'question' field per line (default: the embedded task's RL prompts)")
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "tiny_fp8_e2e_kv.yaml"),
                    help="the recipe of engine and trainer (needs an FP8 KV cache)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "kv-attribution"))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="policy.generation.max_new_tokens (default: the recipe's)")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--fp8-recipe", default=None, choices=RECIPES,
                    help="the checkpoint's FP8 recipe (the recipe's trainer fp8_cfg; the engine follows)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override (repeatable)")
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
    overrides = [*args.overrides, f"grpo.seed={args.seed}", f"run_dir={run_dir}"]
    if args.max_tokens is not None:
        overrides.append(f"policy.generation.max_new_tokens={args.max_tokens}")
    if args.fp8_recipe is not None:
        overrides += fp8_overrides(args.recipe, {"fp8_recipe": args.fp8_recipe}, overrides)
    cfg = load_config(args.recipe, overrides)
    from transformers import AutoTokenizer

    from embedded.tiny_model import chat_prompt

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    random.Random(args.seed).shuffle(rows)
    prompts = [chat_prompt(tok, r["question"], cfg.data.task) for r in rows[:args.prompts]]
    t0 = time.perf_counter()
    table = attribution(model_dir, prompts, cfg, run_dir=run_dir, n=args.n, seed=args.seed)
    g = cfg.policy.generation
    print(f"model: {model_dir}; recipe {args.recipe} (overrides {overrides}); {len(prompts)} prompts x n={args.n}, "
          f"max_tokens={g.max_new_tokens}, T={g.temperature}, seed {args.seed}, "
          f"{cfg.calibration.kv_calibration_samples} calibration sequences")
    print(format_attribution(table))
    print(f"(computed in {time.perf_counter() - t0:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
