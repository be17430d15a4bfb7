"""Train/inference mismatch: vLLM rollout logprobs vs the trainer's (HF model, optionally FP8 via fp8core).

For a batch of sequences sampled by the rollout engine, the trainer recomputes ``log pi(token | prefix)`` with a
teacher-forced forward; ``mismatch/token_mult_prob_error = mean_t exp(|logp_train - logp_rollout|)`` over generated
tokens (NeMo RL's metric, fp8core.rl.metrics.mismatch_metrics; 1.0 = identical).

The table of issue 3, on the tiny model (after a short SFT so the distribution is not near-uniform)::

    (a) BF16 rollout            / BF16 trainer
    (b) FP8 rollout (linears)   / BF16 trainer
    (c) FP8 rollout (linears)   / FP8 trainer (fp8core.convert.convert_to_fp8, same layers, same pow2 flags)
    (d) FP8 rollout + FP8 KV    / FP8 trainer (K/V scales: fp8core.rl.kv_calibration on the FP8 trainer)

Print it with ``.venv/bin/python -m diagnostics.mismatch`` (options: ``--help``); by default it uses the pipeline's SFT
warm start cached under runs/assets (built there first if missing, as flows/bootstrap.py would).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cluster.env import apply_env
from configs.schema import Config, standalone_engine_config
from fp8core.linear import RECIPES
from rollout.engine import RolloutWorker

ROOT = Path(__file__).resolve().parents[1]



def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` [B, max_len] and its ``attention_mask`` for token-id sequences."""
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
        attn[i, :len(x)] = 1
    return ids, attn

def load_trainer_model(model_dir: str | Path, *, fp8: bool, num_first_layers_in_bf16: int = 0,
                       num_last_layers_in_bf16: int = 0, pow2_weight: bool = False, pow2_activation: bool = False,
                       dtype: torch.dtype = torch.bfloat16, recipe: str = "blockwise"):
    """The trainer-side HF model in ``dtype``; with ``fp8`` its decoder linears run fp8core's FP8 in ``recipe``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    from fp8core.moe import convert_routers

    convert_routers(model)  # MoE models: FP32 router logits, vLLM's routing rule (fp8core/moe.py)
    if fp8:
        from fp8core.convert import convert_to_fp8
        from fp8core.linear import FP8LinearConfig

        convert_to_fp8(model, FP8LinearConfig(recipe=recipe, pow2_weight=pow2_weight,
                                              pow2_activation=pow2_activation),
                       num_first_layers_in_bf16=num_first_layers_in_bf16,
                       num_last_layers_in_bf16=num_last_layers_in_bf16)
    return model


@torch.no_grad()
def trainer_logprobs(model, prompt_ids: list[list[int]], response_ids: list[list[int]], *, temperature: float = 1.0,
                     batch_size: int = 16, pad_id: int = 0) -> list[torch.Tensor]:
    """Per sequence, ``log_softmax(logits / temperature)[t, response_t]`` for each response token (FP32).

    Teacher-forced forward over prompt + response (right-padded, attention-masked); the logit at position
    ``len(prompt) + j - 1`` predicts response token ``j``.
    """
    out: list[torch.Tensor] = []
    for start in range(0, len(prompt_ids), batch_size):
        ps, rs = prompt_ids[start:start + batch_size], response_ids[start:start + batch_size]
        ids, attn = pad_right([p + r for p, r in zip(ps, rs, strict=True)], pad_id)
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out.append(logp[i, pos, torch.tensor(r, dtype=torch.long)])
    return out


def quick_sft_model(root: str | Path, *, steps: int = 12, batch_size: int = 8, lr: float = 3e-3,
                    moe: bool = False) -> Path:
    """Tiny model + a very short SFT (embedded.bootstrap.sft_bootstrap) under ``root``, cached by its recipe: a few
    dozen AdamW steps already turn the near-uniform random-init distribution into a peaked one (tests, quick runs).
    ``moe``: the tiny Qwen3-MoE (embedded.tiny_model.TINY_MOE) instead of the dense model."""
    from embedded.bootstrap import SFTConfig, sft_bootstrap
    from embedded.math_task import generate_splits
    from embedded.tiny_model import TINY_MOE, build_tiny_model

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


def flatten_results(results: list[dict]) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """RolloutWorker.generate output -> (prompt ids, response ids, rollout logprobs), one entry per sample."""
    ps, rs, lps = [], [], []
    for r in results:
        for s in r["samples"]:
            if s["token_ids"]:
                ps.append(r["prompt_token_ids"])
                rs.append(s["token_ids"])
                lps.append(s["logprobs"])
    return ps, rs, lps


def mismatch(train_lps: list[torch.Tensor], rollout_lps: list[list[float]]) -> dict[str, float]:
    """fp8core.rl.metrics.mismatch_metrics over padded [B, T] tensors (+ the token count)."""
    from fp8core.rl.metrics import mismatch_metrics

    width = max(len(x) for x in rollout_lps)
    tr = torch.zeros(len(rollout_lps), width, dtype=torch.float64)
    ro = torch.zeros_like(tr)
    mask = torch.zeros_like(tr)
    for i, (t, r) in enumerate(zip(train_lps, rollout_lps, strict=True)):
        tr[i, :len(r)] = t.double()
        ro[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, :len(r)] = 1
    m = mismatch_metrics(tr, ro, mask)
    m["tokens"] = int(mask.sum())
    return m


def calibrate_kv_scales(model, prompt_ids: list[list[int]], response_ids: list[list[int]] | None = None, *,
                        batch_size: int = 16, pad_id: int = 0) -> dict[str, list[float]]:
    """Per-layer Q/K/V scales from fp8core.rl.kv_calibration (post-RoPE amax percentile * margin / 448) on the
    given sequences (prompt + response when given), right-padded micro-batches with an attention mask."""
    from fp8core.rl.kv_calibration import calibrate_kv_scales as calibrate

    seqs = [p + r for p, r in zip(prompt_ids, response_ids, strict=True)] if response_ids else list(prompt_ids)
    batches = []
    for start in range(0, len(seqs), batch_size):
        ids, attn = pad_right(seqs[start:start + batch_size], pad_id)
        batches.append({"input_ids": ids, "attention_mask": attn})
    with torch.no_grad():
        return calibrate(model, batches)


def sample_and_compare(model_dir: Path, cfg: Config, *, run_dir: Path, prompts: list[str], trainers: dict,
                       n: int, max_tokens: int, temperature: float, seed: int,
                       kv_scales: dict | None = None) -> tuple[dict, dict, tuple]:
    """Start an engine with ``cfg``, sample, stop it; compare its logprobs with each trainer model in ``trainers``."""
    worker = RolloutWorker(model_dir, cfg, run_dir=run_dir)
    try:
        if kv_scales is not None:
            worker.set_kv_scales(kv_scales)
        results = worker.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
        stats = worker.stats()
    finally:
        worker.shutdown()
    ps, rs, lps = flatten_results(results)
    rows = {}
    for name, model in trainers.items():
        rows[name] = mismatch(trainer_logprobs(model, ps, rs, temperature=temperature), lps)
    return rows, stats, (ps, rs)


def mismatch_table(model_dir: str | Path, *, run_dir: str | Path, prompts: list[str], n: int = 4,
                   max_tokens: int = 32, temperature: float = 1.0, seed: int = 0,
                   base: dict | None = None) -> dict:
    """Rows (a)-(d) of the module docstring: {row: {metric: value}} plus KV capacities and the scales used."""
    model_dir, run_dir = Path(model_dir), Path(run_dir)
    base = dict(base if base is not None else {"max_model_len": 512})  # policy.generation.vllm_cfg keys
    fp8_keys = {k: base.pop(k) for k in list(base) if k in ("fp8_recipe", "num_first_layers_in_bf16",
                                                             "num_last_layers_in_bf16", "pow2_weight_scaling_factors",
                                                             "pow2_activation_scaling_factors")}
    spec = standalone_engine_config(precision="fp8", **fp8_keys, **base).rollout_fp8_spec()
    layer_kw = dict(num_first_layers_in_bf16=spec.num_first_layers_in_bf16,
                    num_last_layers_in_bf16=spec.num_last_layers_in_bf16)
    trainer_bf16 = load_trainer_model(model_dir, fp8=False)
    trainer_fp8 = load_trainer_model(model_dir, fp8=True, pow2_weight=spec.pow2_weight,
                                     pow2_activation=spec.pow2_activation, recipe=spec.recipe, **layer_kw)
    kw = dict(run_dir=run_dir, prompts=prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
    bf16_cfg = standalone_engine_config(precision="bfloat16", kv_cache_dtype="auto", **base)
    fp8_cfg = standalone_engine_config(precision="fp8", kv_cache_dtype="auto", **fp8_keys, **base)
    fp8kv_cfg = standalone_engine_config(precision="fp8", kv_cache_dtype="fp8", **fp8_keys, **base)
    a, st_a, _ = sample_and_compare(model_dir, bf16_cfg, trainers={"a": trainer_bf16}, **kw)
    bc, _, (ps, rs) = sample_and_compare(model_dir, fp8_cfg, trainers={"b": trainer_bf16, "c": trainer_fp8}, **kw)
    # K/V scales calibrated on the FP8 trainer with the FP8 policy's own rollouts (what the pipeline does at refit)
    kv_scales = calibrate_kv_scales(trainer_fp8, ps, rs)
    d, st_d, _ = sample_and_compare(model_dir, fp8kv_cfg, trainers={"d": trainer_fp8}, kv_scales=kv_scales, **kw)
    return {"rows": {**a, **bc, **d}, "kv_capacity_tokens": {"bf16": st_a["kv_capacity_tokens"],
                                                             "fp8": st_d["kv_capacity_tokens"]},
            "kv_cache_memory_bytes": fp8kv_cfg.policy.generation.vllm_cfg.kv_cache_memory_bytes, "kv_scales": kv_scales,
            "kv_mode": st_d["kv_mode"], "cpu_kind": st_d["cpu"]["kind"]}


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


ROW_LABELS = {
    "a": "(a) BF16 rollout / BF16 trainer",
    "b": "(b) FP8 rollout / BF16 trainer",
    "c": "(c) FP8 rollout / FP8 trainer",
    "d": "(d) FP8 rollout + FP8 KV / FP8 trainer",
}


def format_table(table: dict) -> str:
    lines = ["| setting | token_mult_prob_error | kl_k3(rollout‖train) | max abs Δlogp | tokens |",
             "|---|---|---|---|---|"]
    for key, label in ROW_LABELS.items():
        m = table["rows"][key]
        lines.append(f"| {label} | {m['mismatch/token_mult_prob_error']:.4f} | "
                     f"{m['mismatch/kl_k3_rollout_train']:.2e} | {m['mismatch/max_abs_logp_diff']:.3f} | "
                     f"{m['tokens']} |")
    cap = table["kv_capacity_tokens"]
    lines.append("")
    lines.append(f"KV capacity under {table['kv_cache_memory_bytes']} bytes: bf16 {cap['bf16']} tokens, "
                 f"fp8 {cap['fp8']} tokens; row (d) FP8 KV cache {table.get('kv_mode', '?')} on CPU kind "
                 f"{table.get('cpu_kind', '?')} (emulated: BF16 capacity, rounding to nearest; native CPU: "
                 f"truncation toward zero)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Print the (a)-(d) train/inference mismatch table on the tiny model")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "mismatch"))
    ap.add_argument("--model-dir", help="an HF model dir to use instead of building + SFT-ing the tiny model")
    ap.add_argument("--assets-dir", default=str(ROOT / "runs" / "assets"),
                    help="the pipeline's embedded-assets cache (flows/bootstrap.py): its SFT warm start is reused, "
                         "or built there with embedded.bootstrap.ensure_default_assets")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT warm start steps (default: SFTConfig's)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-first-layers-in-bf16", type=int, default=0)
    ap.add_argument("--num-last-layers-in-bf16", type=int, default=0)
    ap.add_argument("--pow2", action="store_true", help="pow2 weight and activation scaling factors")
    ap.add_argument("--fp8-recipe", default="blockwise", choices=RECIPES,
                    help="FP8 recipe of rows (b)-(d): engine and trainer run the same one")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    apply_env(run_dir)
    from embedded.bootstrap import SFTConfig, ensure_default_assets
    from embedded.math_task import make_problem
    from embedded.tiny_model import chat_prompt

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        sft = SFTConfig() if args.sft_steps is None else SFTConfig(steps=args.sft_steps)
        model_dir = ensure_default_assets(Path(args.assets_dir), task="arithmetic", sft=sft)["model_dir"]
    tok = _tokenizer(model_dir)
    import random

    rng = random.Random(1234)
    prompts = [chat_prompt(tok, make_problem(rng)["question"], "arithmetic") for _ in range(args.prompts)]
    base = dict(max_model_len=512, fp8_recipe=args.fp8_recipe, num_first_layers_in_bf16=args.num_first_layers_in_bf16,
                         num_last_layers_in_bf16=args.num_last_layers_in_bf16,
                         pow2_weight_scaling_factors=args.pow2, pow2_activation_scaling_factors=args.pow2)
    t0 = time.perf_counter()
    table = mismatch_table(model_dir, run_dir=run_dir, prompts=prompts, n=args.n, max_tokens=args.max_tokens,
                           temperature=args.temperature, seed=args.seed, base=base)
    print(f"model: {model_dir}; {args.prompts} prompts x n={args.n}, "
          f"max_tokens={args.max_tokens}, temperature={args.temperature}, first/last BF16 layers "
          f"{args.num_first_layers_in_bf16}/{args.num_last_layers_in_bf16}, pow2={args.pow2}, "
          f"FP8 recipe {args.fp8_recipe}")
    print(format_table(table))
    print(f"(table computed in {time.perf_counter() - t0:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
