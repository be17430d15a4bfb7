"""The project's GRPO step, in one process, phase by phase: refit (policy weights -> vLLM), rollout (vLLM
generate), reward, train (PolicyWorker.train_step: old-logprob pass + updates). Orchestration (Prefect tasks,
Ray calls, MLflow) is not in this number: the flow adds it on top (measured: ~0.7% of a step;
every run logs it as ``time/share_orchestration``).

    .venv/bin/python -m bench.step configs/tiny_fp8_e2e.yaml --steps 4     # prints JSON
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.workload import ROOT, Workload, default_workload, reward, step_rows


def recipe_overrides(w: Workload) -> list[str]:
    return [f"grpo.num_prompts_per_step={w.num_prompts}", f"grpo.num_generations_per_prompt={w.num_generations}",
            f"policy.train_global_batch_size={w.global_batch}", f"policy.train_micro_batch_size={w.micro_batch}",
            f"policy.generation.max_new_tokens={w.max_new_tokens}", f"policy.optimizer.lr={w.lr}",
            f"grpo.seed={w.seed}",
            # TRL's GRPOTrainer trains on every group; DAPO's filter would drop identical-reward groups (less work)
            "grpo.dynamic_sampling=false"]


def run_project(recipe: str, w: Workload, *, steps: int = 4, overrides: tuple[str, ...] = ()) -> dict:
    """Time ``steps`` RL steps of ``recipe`` on workload ``w``; per-step phase times and the medians of steps 2.."""
    from configs.schema import load_config
    from embedded.tiny_model import chat_prompt
    from rollout.engine import RolloutWorker
    from tasks.rl import rollout_seed
    from trainer.policy import PolicyWorker

    cfg = load_config(ROOT / recipe, [*recipe_overrides(w), *overrides])
    run_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=ROOT / "runs"))
    rollout = RolloutWorker(w.model_dir, cfg, run_dir=run_dir / "rollout")
    policy = PolicyWorker(w.model_dir, cfg, run_dir=run_dir / "policy")
    gen = cfg.policy.generation
    per_step = []
    try:
        for step in range(1, steps + 1):
            rows = step_rows(w, step - 1)
            t0 = time.perf_counter()
            rollout.refit(policy.weights())
            t1 = time.perf_counter()
            outs = rollout.generate([chat_prompt(policy.tokenizer, r["question"]) for r in rows],
                                    n=w.num_generations, max_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                    top_p=gen.top_p, seed=rollout_seed(w.seed, step))
            t2 = time.perf_counter()
            rewards = [reward(s["text"], r["answer"]) for o, r in zip(outs, rows, strict=True) for s in o["samples"]]
            t3 = time.perf_counter()
            m = policy.train_step(outs, rewards, step=step)
            t4 = time.perf_counter()
            gen_tokens = sum(len(s["token_ids"]) for o in outs for s in o["samples"])
            per_step.append({
                "step_s": t4 - t0, "refit_s": t1 - t0, "rollout_s": t2 - t1, "reward_s": t3 - t2, "train_s": t4 - t3,
                "old_logprob_s": m["time/train_logprob_s"], "optimizer_s": m.get("time/train_optimizer_s", 0.0),
                "reference_logprob_s": m.get("time/reference_logprob_s", 0.0),
                "train_fwd_bwd_s": m["time/policy_train_s"] - m["time/train_logprob_s"]
                - m.get("time/train_optimizer_s", 0.0) - m["time/clip_calibration_s"],
                "generated_tokens": gen_tokens, "reward_mean": m["reward/mean"],
                "token_mult_prob_error": m["mismatch/token_mult_prob_error"]})
    finally:
        rollout.shutdown()
    tail = per_step[1:] if len(per_step) > 1 else per_step
    med = {k: statistics.median(s[k] for s in tail) for k in tail[0]}
    return {"recipe": recipe, "overrides": list(overrides), "steps": per_step, "median": med,
            "bf16_mode": policy.info().get("bf16_mode"), "threads": torch.get_num_threads(),
            "peak_rss_mb": policy.memory()["peak"] / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    print(json.dumps(run_project(args.recipe, default_workload(), steps=args.steps, overrides=tuple(args.overrides))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
