"""The MoE mismatch table (issue 14): train/inference mismatch of the tiny dense model vs its Mixture-of-Experts twin,
BF16 and end-to-end FP8, with routing replay off and on.

For each model and precision one rollout engine samples the same prompts (vLLM, the pipeline's RolloutWorker; MoE
engines also return each token's experts), then the trainer-side model of the same precision (HF transformers +
fp8core, FP32 master weights as the tiny recipes' ``policy.precision: float32``; FP8: blockwise experts and linears,
FP32 router) rescoring every sampled sequence teacher-forced, one sequence per forward:

* ``token_mult_prob_error`` = mean over response tokens of ``exp(|logp_train - logp_rollout|)`` (1 = identical);
* ``routing_mismatch_frac`` (MoE) = fraction of the sequences' tokens whose top-k expert set from the trainer's own
  router differs from the engine's;
* replay on: the trainer routes every token to the engine's experts (fp8core.moe.forced_routing).

Print it with ``.venv/bin/python -m diagnostics.moe_mismatch`` (``--help``); it uses the pipeline's SFT warm starts of
both models under runs/assets (built there first if missing, as flows/bootstrap.py would).
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
from diagnostics.mismatch import load_trainer_model, mismatch
from rollout.engine import RolloutWorker

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def rescore(model, results: list[dict], *, replay: bool, temperature: float = 1.0) -> tuple[list, list, dict]:
    """(trainer logprobs per sample, rollout logprobs per sample, routing counts) for ``generate`` results."""
    from fp8core.moe import forced_routing, routers

    rs = routers(model)
    train, roll, mis, tok = [], [], 0, 0
    for r in results:
        for s in r["samples"]:
            if not s["token_ids"]:
                continue
            seq = list(r["prompt_token_ids"]) + list(s["token_ids"])
            ids = torch.tensor([seq])
            routed = s.get("routed_experts")
            forced = ({layer: routed[:, j].long() for j, (layer, _) in enumerate(rs)}
                      if replay and routed is not None else None)
            with forced_routing(model, forced):
                logits = model(input_ids=ids).logits[0, :-1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            train.append(lp[len(r["prompt_token_ids"]) - 1:])
            roll.append(s["logprobs"])
            if routed is not None:
                for j, (_, router) in enumerate(rs):
                    own = router.last_own_ids.sort(-1).values
                    mis += int((own != routed[:, j].long().sort(-1).values).any(-1).sum())
                    tok += own.shape[0]
    return train, roll, {"mismatch": mis, "tokens": tok}


def measure(model_dir: Path, *, fp8: bool, prompts: list[str], run_dir: Path, n: int, max_tokens: int,
            seed: int) -> dict[str, dict]:
    """{replay off/on: metrics} for one model and precision (replay only for MoE models)."""
    cfg = standalone_engine_config(precision="fp8" if fp8 else "bfloat16", kv_cache_memory_bytes=32 << 20,
                                   max_model_len=256)
    worker = RolloutWorker(model_dir, cfg, run_dir=run_dir)
    try:
        results = worker.generate(prompts, n=n, max_tokens=max_tokens, seed=seed, routing=True)
        moe = worker.is_moe
    finally:
        worker.shutdown()
    model = load_trainer_model(model_dir, fp8=fp8, dtype=torch.float32)
    out = {}
    for replay in ((False, True) if moe else (False,)):
        train, roll, rc = rescore(model, results, replay=replay)
        m = mismatch(train, roll)
        if moe:
            m["moe/routing_mismatch_frac"] = rc["mismatch"] / max(1, rc["tokens"])
        out["on" if replay else "off"] = m
    return out


def format_table(table: dict) -> str:
    lines = ["| model | rollout / trainer | routing replay | token_mult_prob_error | max abs Δlogp | "
             "routing mismatch (tokens x layers) | tokens |", "|---|---|---|---|---|---|---|"]
    for key, rows in table["rows"].items():
        model, prec = key.split("/")
        for replay, m in rows.items():
            rm = m.get("moe/routing_mismatch_frac")
            pair = "FP8 / FP8 (fp8core)" if prec == "fp8" else "BF16 / FP32 masters"
            lines.append(f"| {model} | {pair} | {replay if model == 'moe' else 'n/a'} | "
                         f"{m['mismatch/token_mult_prob_error']:.4f} | {m['mismatch/max_abs_logp_diff']:.3f} | "
                         f"{'-' if rm is None else f'{rm:.4f}'} | {m['tokens']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Print the dense-vs-MoE, BF16/FP8, replay off/on mismatch table")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "moe_mismatch"))
    ap.add_argument("--assets-dir", default=str(ROOT / "runs" / "assets"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    apply_env(run_dir)
    from embedded import addition_task
    from embedded.bootstrap import ADDITION_SPEC, default_sft, ensure_default_assets
    from embedded.tiny_model import chat_prompt

    t0 = time.perf_counter()
    table: dict = {"rows": {}, "models": {}}
    for model in args.models.split(","):
        model_dir = ensure_default_assets(Path(args.assets_dir), task="addition", sft=default_sft("addition"),
                                          model=model)["model_dir"]
        table["models"][model] = str(model_dir)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        rng = random.Random(1234)
        prompts = [chat_prompt(tok, addition_task.make_problem(rng, ADDITION_SPEC)["question"])
                   for _ in range(args.prompts)]
        for fp8 in (False, True):
            key = f"{model}/{'fp8' if fp8 else 'bf16'}"
            table["rows"][key] = measure(model_dir, fp8=fp8, prompts=prompts, run_dir=run_dir / key.replace("/", "-"),
                                         n=args.n, max_tokens=args.max_tokens, seed=args.seed)
    print(f"models: {table['models']}; {args.prompts} addition prompts x n={args.n}, max_tokens={args.max_tokens}, "
          f"temperature 1.0, seed {args.seed}; trainer FP32 masters (FP8: fp8core blockwise), one sequence per "
          "forward; engine BF16 = our BF16-emulated methods on CPUs without BF16 units")
    print(format_table(table))
    print(f"(table computed in {time.perf_counter() - t0:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
