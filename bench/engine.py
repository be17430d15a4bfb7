"""The rollout engine on its own: start time, KV capacity, refit time and generation throughput per precision and KV
cache dtype, through the engine's own RolloutWorker (no Ray, no trainer)."""

from __future__ import annotations

from pathlib import Path

import torch

import process.quiet  # noqa: F401  third-party start-up noise off before vLLM / transformers / torchao load
from process.env import apply_env
from rollout.engine import RolloutWorker


def model_for(run_dir: Path, model_dir: str | None) -> Path:
    """Set the run environment under ``run_dir`` (caches, offline switches) and return the model to load:
    ``model_dir``, else the tiny model built under ``run_dir``."""
    apply_env(run_dir)
    if model_dir:
        return Path(model_dir)
    from embedded.tiny_model import build_tiny_model

    return build_tiny_model(run_dir / "tiny")


def main(argv: list[str] | None = None) -> list[dict]:
    """Print engine start time, KV capacity, refit time and generation throughput per precision / KV dtype:
    ``.venv/bin/python -m bench.engine [--model-dir DIR] [--kv-cache-memory-bytes N]``."""
    import argparse
    import statistics

    from configs.schema import standalone_engine_config

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model-dir", help="HF model dir (default: the tiny model, built under --run-dir)")
    ap.add_argument("--run-dir", default=str(Path(__file__).resolve().parents[1] / "runs" / "rollout-bench"))
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    ap.add_argument("--refits", type=int, default=5)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    model_dir = model_for(run_dir, args.model_dir)
    from safetensors.torch import load_file

    weights = {k: v.float() for k, v in load_file(str(next(model_dir.glob("*.safetensors")))).items()}
    prompts = [[1 + (7 * i + j) % 200 for j in range(32)] for i in range(16)]
    rows = []
    for precision, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("fp8", "auto"), ("fp8", "fp8")):
        w = RolloutWorker(model_dir, standalone_engine_config(precision=precision, kv_cache_dtype=kv,
                                                              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                                              max_model_len=512), run_dir=run_dir)
        try:
            w.generate(prompts[:2], n=1, max_tokens=4, seed=0)  # warm-up (kernel compile on first use)
            w.refit(weights)  # warm-up (first reload imports / allocates)
            refits = [w.refit(weights) for _ in range(args.refits)]
            w.generate(prompts, n=4, max_tokens=64, temperature=1.0, seed=0)
            st = w.stats()
        finally:
            w.shutdown()
        rows.append({"precision": precision, "kv_cache_dtype": kv, "engine_start_s": st["engine_start_s"],
                     "kv_capacity_tokens": st["kv_capacity_tokens"], "refit_ms_median": 1e3 * statistics.median(refits),
                     "tokens_per_s": st["last_tokens_per_s"], "generated_tokens": st["last_generated_tokens"]})
    print(f"model {model_dir}; KV budget {args.kv_cache_memory_bytes} bytes; torch threads {torch.get_num_threads()}")
    print("| precision | kv_cache_dtype | KV capacity (tokens) | refit (median ms, FP32 weights) | gen tokens/s | "
          "engine start (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['kv_cache_dtype']} | {r['kv_capacity_tokens']} | {r['refit_ms_median']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['engine_start_s']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
