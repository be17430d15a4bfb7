"""TRL's GRPOTrainer on the same workload (bench/workload.py): the project's SFT model, prompts, reward and batch
(16 prompts x 8 generations x 32 new tokens; two optimizer updates of 64 per generation round), FP32, HF generate
(use_vllm=False), no KL reference model (beta=0, as the project's recipes). Run with the bench venv
(``.venv-bench/bin/python -m bench.trl_step WORKLOAD_JSON --steps 4``); prints JSON with per-RL-step seconds.

An RL step = one generation round + its two optimizer updates: the time between the end of optimizer update 2k-2
and the end of update 2k (update 0 = trainer start), measured by a callback.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time


def run_trl(w, *, steps: int = 4, threads: int = 2) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.workload import reward, step_rows
    from embedded.tiny_model import chat_prompt

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(w.model_dir)
    tok.padding_side = "left"
    rows = [r for s in range(steps) for r in step_rows(w, s)]
    ds = Dataset.from_list([{"prompt": chat_prompt(tok, r["question"]), "answer": r["answer"]} for r in rows])

    def reward_fn(completions, answer, **_):
        return [reward(c, a) for c, a in zip(completions, answer, strict=True)]

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    updates_per_step = (w.num_prompts * w.num_generations) // w.global_batch
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=w.global_batch,
        gradient_accumulation_steps=1, num_generations=w.num_generations,
        generation_batch_size=w.num_prompts * w.num_generations, max_completion_length=w.max_new_tokens,
        temperature=w.temperature, learning_rate=w.lr, beta=0.0, use_vllm=False, bf16=False, fp16=False,
        use_cpu=True, max_steps=steps * updates_per_step, logging_steps=1, report_to=[], save_strategy="no",
        shuffle_dataset=False, seed=w.seed, lr_scheduler_type="constant", warmup_steps=0, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    per_step = [ends[i * updates_per_step] for i in range(steps + 1) if i * updates_per_step < len(ends)]
    step_s = [b - a for a, b in zip(per_step, per_step[1:], strict=False)]
    tail = step_s[1:] if len(step_s) > 1 else step_s
    return {"steps_s": step_s, "median_step_s": statistics.median(tail), "wall_s": wall,
            "trl": __import__("trl").__version__, "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    from bench.workload import Workload

    argv = sys.argv[1:] if argv is None else argv
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 4
    w = Workload.from_json(argv[0])
    print("BENCH_JSON " + json.dumps(run_trl(w, steps=steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
