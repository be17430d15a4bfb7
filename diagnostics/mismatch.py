"""Train/inference mismatch per recipe: vLLM rollout logprobs vs the logprobs of the trainer that recipe trains with.

Each row is a recipe, and both sides are built from it: ``cfg = load_config(recipe, overrides)``, the rollout engine
``RolloutWorker(model_dir, cfg)`` samples the prompts, the trainer ``PolicyWorker(model_dir, cfg).score(...)``
recomputes ``log pi(token | prefix)`` of every sampled token with the forward of its training step's old-logprob
pass (its FP32 masters, FP8 linears, ``policy.precision``, MoE routing replay, KV rounding: what the run trains
with). ``mismatch/token_mult_prob_error = mean_t exp(|logp_train - logp_rollout|)`` over generated tokens (NeMo
RL's metric, fp8core.rl.mismatch_metrics, as logged every step; 1.0 = identical)::

    (a) configs/tiny_bf16.yaml          BF16 rollout            / FP32 trainer
    (b) configs/tiny_fp8_rollout.yaml   FP8 rollout (linears)   / FP32 trainer (its policy.precision)
    (c) configs/tiny_fp8_e2e.yaml       FP8 rollout (linears)   / FP8 trainer (same FP8 numerics, end to end)
    (d) configs/tiny_fp8_e2e_kv.yaml    (c) + FP8 KV cache      / FP8 trainer
    (e) configs/tiny_mxfp8_e2e.yaml     MXFP8 rollout (linears) / MXFP8 trainer (end to end)

Rows with an FP8 KV cache get their K/V scales as the pipeline does at refit: the row's own trainer calibrates them
(``PolicyWorker.calibrate_kv_scales``, ``calibration.kv_calibration_samples`` sequences) on an FP8 rollout of the
same prompts without the FP8 KV cache (the previous step's rollouts), and the engine takes them
(``set_kv_scales``) before sampling.

Run ``.venv/bin/python -m diagnostics.mismatch`` (``--help``): by default it uses the pipeline's SFT warm start of the
recipes (``bootstrap.*``, ``data.task``; built under runs/assets first if missing, as flows/bootstrap.py would) and
writes the table to docs/results/mismatch.md, stamped with the commit, date, CPU and command line.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / vLLM load
from configs.schema import Config, load_config
from fp8core.linear import RECIPES
from process.env import apply_env
from tools.results import add_results_doc_args, format_result, results_doc, stamp

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ROWS = {"a": "tiny_bf16.yaml", "b": "tiny_fp8_rollout.yaml", "c": "tiny_fp8_e2e.yaml", "d": "tiny_fp8_e2e_kv.yaml",
        "e": "tiny_mxfp8_e2e.yaml"}
TITLE = "Train/inference mismatch per recipe: results"


def quick_sft_model(root: str | Path, *, steps: int = 12, batch_size: int = 8, lr: float = 3e-3,
                    moe: bool = False) -> Path:
    """Tiny model + a very short SFT (embedded.bootstrap.sft_bootstrap) under ``root``, cached by its recipe: a few
    dozen AdamW steps already turn the near-uniform random-init distribution into a peaked one (tests, quick runs).
    ``moe``: the tiny Qwen3-MoE (embedded.tiny_model.TINY_MOE) instead of the dense model."""
    from embedded.bootstrap import SFTConfig, sft_bootstrap
    from embedded.tiny_model import TINY_MOE, build_tiny_model
    from rewards.math_task import generate_splits

    root = Path(root)
    cfg = SFTConfig(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=min(5, steps))
    out = root / f"tiny{'-moe' if moe else ''}-sft-{steps}x{batch_size}"
    marker = out / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == {k: getattr(cfg, k) for k in json.loads(
            marker.read_text())}:
        return out
    base = build_tiny_model(root / "tiny-moe", TINY_MOE) if moe else build_tiny_model(root / "tiny")
    splits = generate_splits(root / "sft-data", n_train=500, n_validation=10)
    return sft_bootstrap(base, splits["train"], out, cfg, log=lambda *_: None, task="arithmetic")


# ------------------------------------------------------------------------------------------------ recipes and inputs
def fp8_overrides(recipe: str | Path, fp8: Mapping[str, object], overrides: Sequence[str] = ()) -> list[str]:
    """FP8 recipe settings (``configs.schema.FP8_RECIPE_KEYS`` names) as ``key=value`` overrides of the section that
    owns them in ``recipe``: the trainer's ``policy.megatron_cfg.fp8_cfg`` when it trains in FP8 (end to end, the
    engine follows it), the rollout's ``policy.generation.vllm_cfg`` when only the rollout is FP8, none for a BF16
    recipe."""
    cfg = load_config(recipe, overrides)
    if cfg.policy.megatron_cfg.fp8_cfg.enabled:
        section = "policy.megatron_cfg.fp8_cfg"
    elif cfg.policy.generation.vllm_cfg.precision == "fp8":
        section = "policy.generation.vllm_cfg"
    else:
        return []
    return [f"{section}.{k}={json.dumps(v)}" for k, v in fp8.items()]


def warm_start(cfg: Config) -> Path:
    """The pipeline's SFT warm start of ``cfg`` (flows/bootstrap.py's assets: ``bootstrap.*``, ``data.task``,
    ``grpo.seed`` or ``bootstrap.sft_seed``), built first if missing."""
    from embedded.bootstrap import default_sft, ensure_default_assets, model_spec

    b = cfg.bootstrap
    sft = default_sft(cfg.data.task, seed=b.warm_start_seed(cfg.grpo.seed), steps=b.sft_steps)
    return ensure_default_assets(Path(b.assets_dir), task=cfg.data.task, sft=sft, model=b.model,
                                 spec=model_spec(b.model, b.model_size()))["model_dir"]


def task_prompts(model_dir: str | Path, task: str, count: int, *, seed: int = 1234) -> list[str]:
    """``count`` chat prompts of the embedded task ``task`` (fresh problems from ``random.Random(seed)``)."""
    from transformers import AutoTokenizer

    from embedded.tiny_model import chat_prompt
    from rewards.registry import get_task

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng, t = random.Random(seed), get_task(task)
    return [chat_prompt(tok, t.make_problem(rng)["question"], task) for _ in range(count)]


def sample(model_dir: Path, cfg: Config, prompts: list[str], *, n: int, seed: int, run_dir: Path,
           kv_scales: Mapping | None = None) -> tuple[list[dict], dict]:
    """Start ``cfg``'s rollout engine, set ``kv_scales`` (if any), sample ``n`` completions per prompt at the recipe's
    ``policy.generation`` settings, stop it; returns (results, engine stats)."""
    from rollout.engine import RolloutWorker

    g = cfg.policy.generation
    worker = RolloutWorker(model_dir, cfg, run_dir=run_dir)
    try:
        if kv_scales is not None:
            worker.set_kv_scales(kv_scales)
        results = worker.generate(prompts, n=n, max_tokens=g.max_new_tokens, temperature=g.temperature,
                                  top_p=g.top_p, seed=seed)
        return results, worker.stats()
    finally:
        worker.shutdown()


def without_fp8_kv(cfg: Config) -> Config:
    """``cfg`` with a BF16 KV cache (and nothing that needs an FP8 one): the engine of the calibration rollout."""
    from configs.schema import config_from_dict

    return config_from_dict(cfg.to_dict(), ["policy.generation.vllm_cfg.kv_cache_dtype=auto",
                                            "policy.generation.vllm_cfg.kv_cache_impl=auto",
                                            "calibration.kv_rounding_in_trainer=false"])


def measure(model_dir: str | Path, cfg: Config, prompts: list[str], *, n: int, seed: int = 0,
            run_dir: str | Path) -> dict:
    """One row: ``cfg``'s engine samples ``prompts``, ``cfg``'s trainer scores them (``PolicyWorker.score``). With an
    FP8 KV cache the engine first gets K/V scales from that trainer, calibrated on an FP8 rollout of the same
    prompts (same seed) without the FP8 KV cache. Returns {"metrics", "logp", "rollouts", "engine", "kv_scales"}."""
    from trainer.policy import PolicyWorker

    model_dir, run_dir = Path(model_dir), Path(run_dir)
    policy = PolicyWorker(model_dir, cfg, run_dir=run_dir)
    scales = None
    if cfg.policy.generation.vllm_cfg.kv_fp8:
        calib, _ = sample(model_dir, without_fp8_kv(cfg), prompts, n=n, seed=seed, run_dir=run_dir / "calibration")
        scales = policy.calibrate_kv_scales(calib, max_samples=cfg.calibration.kv_calibration_samples)
    results, stats = sample(model_dir, cfg, prompts, n=n, seed=seed, run_dir=run_dir / "rollout", kv_scales=scales)
    scored = policy.score(results)
    engine = {k: stats[k] for k in ("kv_capacity_tokens", "kv_mode", "kv_bytes_per_token", "kv_cache_memory_bytes",
                                    "bf16_mode", "precision")}
    engine["cpu_kind"] = stats["cpu"]["kind"]
    return {"metrics": scored["metrics"], "logp": scored["logp"], "rollouts": results, "engine": engine,
            "kv_scales": scales}


def describe(cfg: Config) -> str:
    """'<rollout> / <trainer>' of a recipe, e.g. 'FP8 blockwise + FP8 KV / FP8 blockwise, FP32 masters'."""
    vc, p = cfg.policy.generation.vllm_cfg, cfg.policy
    ro, tr = cfg.rollout_fp8_spec(), cfg.trainer_fp8_spec()
    rollout = ("BF16" if ro is None else f"FP8 {ro.recipe}") + (" + FP8 KV" if vc.kv_fp8 else "")
    trainer = ("" if tr is None else f"FP8 {tr.recipe}, ") + "FP32 masters" + (
        ", BF16 autocast" if p.precision == "bfloat16" else "")
    if p.router_replay.enabled:
        trainer += ", routing replay"
    if cfg.calibration.kv_rounding_in_trainer:
        trainer += ", K/V rounded like the engine"
    return f"{rollout} / {trainer}"


def mismatch_table(model_dir: str | Path, *, run_dir: str | Path, prompts: list[str], n: int = 4, seed: int = 0,
                   overrides: Sequence[str] = (), fp8: Mapping[str, object] | None = None,
                   rows: Mapping[str, str] = ROWS) -> dict:
    """Rows (a)-(e) of the module docstring: ``load_config(configs/<recipe>, overrides + FP8 settings + run_dir)``
    per row, measured by :func:`measure`. Returns the JSON-able table (rows' metrics, recipes, engines, K/V scales)
    plus ``"scored"``: per row the trainer's logprobs ``[B, L]`` and the rollouts (not JSON)."""
    run_dir = Path(run_dir)
    table: dict = {"rows": {}, "recipes": {}, "engines": {}, "kv_scales": {}, "scored": {}}
    for key, recipe in rows.items():
        path = CONFIGS / recipe
        row_over = [*overrides, *fp8_overrides(path, fp8 or {}, overrides), f"run_dir={run_dir / key}"]
        cfg = load_config(path, row_over)
        r = measure(model_dir, cfg, prompts, n=n, seed=seed, run_dir=run_dir / key)
        table["rows"][key] = r["metrics"]
        table["recipes"][key] = {"recipe": f"configs/{recipe}", "overrides": row_over, "describe": describe(cfg),
                                 "precision_tag": cfg.precision_tag}
        table["engines"][key] = r["engine"]
        if r["kv_scales"] is not None:
            table["kv_scales"][key] = r["kv_scales"]
        table["scored"][key] = {"logp": r["logp"], "rollouts": r["rollouts"]}
    return table


# ------------------------------------------------------------------------------------------------------------ output
def format_table(table: dict) -> str:
    lines = ["| row | recipe | rollout / trainer | token_mult_prob_error | kl_k3(rollout‖train) | max abs Δlogp | "
             "tokens |", "|---|---|---|---|---|---|---|"]
    for key, m in table["rows"].items():
        rec = table["recipes"][key]
        lines.append(f"| ({key}) | {rec['recipe']} | {rec['describe']} | {m['mismatch/token_mult_prob_error']:.4f} | "
                     f"{m['mismatch/kl_k3_rollout_train']:.2e} | {m['mismatch/max_abs_logp_diff']:.3f} | "
                     f"{m['tokens']} |")
    lines.append("")
    eng = [f"({k}) {e['kv_capacity_tokens']} tokens of {e['kv_cache_memory_bytes']} bytes, KV {e['kv_mode']}"
           + (f", BF16 {e['bf16_mode']}" if e["bf16_mode"] != "off" else "") for k, e in table["engines"].items()]
    lines.append("Engines: " + "; ".join(eng) + " (FP8 KV emulated: BF16 capacity, rounding to nearest; native CPU: "
                 "truncation toward zero).")
    return "\n".join(lines)


NOTE = ("What each row measures: [the FP8 contract](../fp8-contract.md#the-mismatch-measured-every-step) and "
        "diagnostics/mismatch.py's docstring: each row's engine and trainer are built from its recipe, the trainer "
        "scores with `PolicyWorker.score` (the forward it trains with).")


def format_results(table: dict) -> str:
    """docs/results/mismatch.md: the stamp (tools.results), the settings and the table."""
    s = table["settings"]
    model = (f"- model: `{table['model_dir']}`; {s['prompts']} {s['task']} prompts x n={s['n']}, seed {s['seed']}; "
             f"sampling and scoring at each recipe's policy.generation settings")
    body = [format_table(table)]
    if s["overrides"] or s["fp8"]:
        body.insert(0, f"- overrides (every row): `{' '.join(s['overrides']) or '-'}`; FP8 settings: "
                       f"`{s['fp8'] or '-'}`\n")
    return format_result(TITLE, "\n".join(body), table["stamp"], note=NOTE, details=[model])


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description="The (a)-(e) train/inference mismatch table: one row per recipe, "
                                             "engine and trainer built from it (module docstring)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "mismatch"))
    ap.add_argument("--model-dir", help="an HF model dir to use instead of the recipes' SFT warm start")
    ap.add_argument("--assets-dir", help="bootstrap.assets_dir of every recipe (default: theirs, runs/assets)")
    ap.add_argument("--sft-steps", type=int, default=None, help="bootstrap.sft_steps of every recipe")
    ap.add_argument("--task", help="embedded task of the prompts (default: the recipes' data.task)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="policy.generation.max_new_tokens of every recipe (default: theirs)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="policy.generation.temperature of every recipe: sampling and scoring (default: theirs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-first-layers-in-bf16", type=int, default=None)
    ap.add_argument("--num-last-layers-in-bf16", type=int, default=None)
    ap.add_argument("--pow2", action="store_true", help="pow2 weight and activation scaling factors")
    ap.add_argument("--fp8-recipe", default=None, choices=RECIPES,
                    help="FP8 recipe of the FP8 rows (the trainer's fp8_cfg, or the rollout's where only it is FP8)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override applied to every row (repeatable), e.g. "
                         "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216")
    ap.add_argument("--json", help="also write the table as JSON here")
    add_results_doc_args(ap, "mismatch", "--out")
    args = ap.parse_args(argv)
    origin = stamp("diagnostics.mismatch", argv)  # the code that runs: the tree now, before the (minutes of) measurement
    run_dir = Path(args.run_dir)
    apply_env(run_dir)
    overrides = list(args.overrides)
    for key, val in (("bootstrap.assets_dir", args.assets_dir), ("bootstrap.sft_steps", args.sft_steps),
                     ("policy.generation.max_new_tokens", args.max_tokens),
                     ("policy.generation.temperature", args.temperature)):
        if val is not None:
            overrides.append(f"{key}={val}")
    fp8 = {k: v for k, v in (("fp8_recipe", args.fp8_recipe),
                             ("num_first_layers_in_bf16", args.num_first_layers_in_bf16),
                             ("num_last_layers_in_bf16", args.num_last_layers_in_bf16)) if v is not None}
    if args.pow2:
        fp8.update(pow2_weight_scaling_factors=True, pow2_activation_scaling_factors=True)
    first = load_config(CONFIGS / ROWS["a"], overrides)
    model_dir = Path(args.model_dir) if args.model_dir else warm_start(first)
    task = args.task or first.data.task
    prompts = task_prompts(model_dir, task, args.prompts)
    t0 = time.perf_counter()
    table = mismatch_table(model_dir, run_dir=run_dir, prompts=prompts, n=args.n, seed=args.seed,
                           overrides=overrides, fp8=fp8)
    table["model_dir"] = str(model_dir)
    table["settings"] = {"prompts": args.prompts, "task": task, "n": args.n, "seed": args.seed,
                         "overrides": overrides, "fp8": fp8}
    table["stamp"] = origin
    text = format_results(table)
    print(text)
    print(f"(table computed in {time.perf_counter() - t0:.1f}s)")
    plain = {k: v for k, v in table.items() if k != "scored"}
    out = results_doc(args)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(plain, indent=2))
    return table


if __name__ == "__main__":
    main()
