"""The MoE mismatch table: train/inference mismatch of the tiny dense model vs its Mixture-of-Experts twin,
BF16 and end-to-end FP8, with routing replay off and on.

Each row is a recipe, and both sides are built from it (as diagnostics/mismatch.py): dense rows
configs/tiny_bf16.yaml and configs/tiny_fp8_e2e.yaml, MoE rows configs/tiny_moe_bf16.yaml and
configs/tiny_moe_fp8_e2e.yaml. Per (model, precision) the recipe's rollout engine (the pipeline's RolloutWorker;
MoE engines also return each token's experts) samples the same prompts once; then the recipe's trainer
(``PolicyWorker.score``: FP32 masters, FP8 experts and linears for the FP8 recipe, FP32 router) scores them, for MoE
once with ``policy.router_replay.enabled: false`` and once with ``true``:

* ``token_mult_prob_error`` = mean over response tokens of ``exp(|logp_train - logp_rollout|)`` (1 = identical);
* ``moe/routing_mismatch_frac`` (MoE) = fraction of the sequences' (token, layer) pairs whose top-k expert set from
  the trainer's own router differs from the engine's, as logged every step;
* replay on: the trainer routes every token to the engine's experts (fp8core.moe.forced_routing).

Print it with ``.venv/bin/python -m diagnostics.moe_mismatch`` (``--help``); it uses the pipeline's SFT warm starts of
both models (the recipes' ``bootstrap.*``; built under runs/assets first if missing, as flows/bootstrap.py would).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / vLLM load
from configs.schema import Config, load_config
from diagnostics.mismatch import CONFIGS, ROOT, describe, task_prompts, warm_start
from process.env import apply_env

RECIPES = {"dense/bf16": "tiny_bf16.yaml", "dense/fp8": "tiny_fp8_e2e.yaml", "moe/bf16": "tiny_moe_bf16.yaml",
           "moe/fp8": "tiny_moe_fp8_e2e.yaml"}


def measure(model_dir: Path, cfg: Config, prompts: list[str], *, run_dir: Path, n: int, seed: int) -> dict[str, dict]:
    """{replay off/on: metrics} for one recipe (replay only for MoE models): one rollout with routing, scored by
    the recipe's trainer with ``policy.router_replay.enabled`` false and true."""
    from configs.schema import config_from_dict
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    g = cfg.policy.generation
    worker = RolloutWorker(model_dir, cfg, run_dir=run_dir / "rollout")
    try:
        results = worker.generate(prompts, n=n, max_tokens=g.max_new_tokens, temperature=g.temperature,
                                  top_p=g.top_p, seed=seed, routing=True)
        moe = worker.is_moe
    finally:
        worker.shutdown()
    out = {}
    for replay in ((False, True) if moe else (False,)):
        c = config_from_dict(cfg.to_dict(), [f"policy.router_replay.enabled={str(replay).lower()}"])
        out["on" if replay else "off"] = PolicyWorker(model_dir, c, run_dir=run_dir).score(results)["metrics"]
    return out


def format_table(table: dict) -> str:
    lines = ["| model | recipe | rollout / trainer | routing replay | token_mult_prob_error | max abs Δlogp | "
             "routing mismatch (tokens x layers) | tokens |", "|---|---|---|---|---|---|---|---|"]
    for key, rows in table["rows"].items():
        model = key.split("/")[0]
        rec = table["recipes"][key]
        for replay, m in rows.items():
            rm = m.get("moe/routing_mismatch_frac")
            lines.append(f"| {model} | {rec['recipe']} | {rec['describe']} | {replay if model == 'moe' else 'n/a'} | "
                         f"{m['mismatch/token_mult_prob_error']:.4f} | {m['mismatch/max_abs_logp_diff']:.3f} | "
                         f"{'-' if rm is None else f'{rm:.4f}'} | {m['tokens']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Print the dense-vs-MoE, BF16/FP8, replay off/on mismatch table")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "moe_mismatch"))
    ap.add_argument("--assets-dir", help="bootstrap.assets_dir of every recipe (default: theirs, runs/assets)")
    ap.add_argument("--dense-model-dir", help="an HF model dir for the dense rows instead of the SFT warm start")
    ap.add_argument("--moe-model-dir", help="an HF model dir for the MoE rows instead of the SFT warm start")
    ap.add_argument("--task", help="embedded task of the prompts (default: the recipes' data.task)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="policy.generation.max_new_tokens of every recipe (default: theirs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override applied to every row (repeatable)")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    apply_env(run_dir)
    overrides = list(args.overrides)
    for key, val in (("bootstrap.assets_dir", args.assets_dir), ("policy.generation.max_new_tokens", args.max_tokens)):
        if val is not None:
            overrides.append(f"{key}={val}")
    given = {"dense": args.dense_model_dir, "moe": args.moe_model_dir}
    t0 = time.perf_counter()
    table: dict = {"rows": {}, "recipes": {}, "models": {}}
    for model in args.models.split(","):
        prompts = None
        for prec in ("bf16", "fp8"):
            key = f"{model}/{prec}"
            cfg = load_config(CONFIGS / RECIPES[key], [*overrides, f"run_dir={run_dir / key.replace('/', '-')}"])
            model_dir = Path(given[model]) if given[model] else warm_start(cfg)
            table["models"][model] = str(model_dir)
            if prompts is None:  # the same prompts for both precisions of a model
                prompts = task_prompts(model_dir, args.task or cfg.data.task, args.prompts)
            table["recipes"][key] = {"recipe": f"configs/{RECIPES[key]}", "describe": describe(cfg)}
            table["rows"][key] = measure(model_dir, cfg, prompts, run_dir=Path(cfg.run_dir), n=args.n,
                                         seed=args.seed)
    print(f"models: {table['models']}; {args.prompts} prompts x n={args.n}, seed {args.seed}, sampled and scored at "
          f"each recipe's policy.generation settings; overrides {overrides or '-'}")
    print(format_table(table))
    print(f"(table computed in {time.perf_counter() - t0:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
