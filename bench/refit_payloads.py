"""Refit payloads side by side: bytes on the wire and engine refit time for the three ways to ship a policy to an
FP8 rollout engine, measured in one run on one engine.

    .venv/bin/python -m bench.refit_payloads [--model-dir DIR] [--recipe blockwise|rowwise|tensorwise] [--repeats 5]

* ``fp32``: the FP32 masters (``PolicyWorker.weights()``); the engine quantizes its FP8 layers.
* ``bf16``: BF16 copies -- what the pipeline shipped before the refit fix (the engine then held ``quantize(bf16(w))``,
  not the trainer's ``quantize(w)``), for reference only.
* ``fp8``: the trainer's served state (``PolicyWorker.refit_weights()``: FP8 codes as bytes + ``weight_scale_inv``,
  BF16 rest); the engine loads it without re-quantizing.

Each payload is pickled and unpickled once per repeat (what Ray's object store does between the actors), then
loaded with ``RolloutWorker.refit``; the table prints medians and ratios to the FP32 refit.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time
from pathlib import Path

from fp8core.linear import RECIPES

ROOT = Path(__file__).resolve().parents[1]


def payloads(model_dir: Path, recipe: str) -> dict[str, dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from fp8core.convert import convert_to_fp8
    from fp8core.linear import FP8LinearConfig
    from fp8core.serve import served_state_dict

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # FP32 masters off the BF16 grid, as after training
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3 * p.std().clamp_min(1e-3))
    convert_to_fp8(model, FP8LinearConfig(recipe=recipe))
    masters = {k: v.detach().clone() for k, v in model.state_dict().items()}
    served = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
              for k, v in served_state_dict(model, hp_dtype=torch.bfloat16).items()}
    return {"fp32": masters, "bf16": {k: v.to(torch.bfloat16) for k, v in masters.items()}, "fp8": served}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="HF model dir (default: the tiny model, built under --run-dir)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "bench-refit-payloads"))
    ap.add_argument("--recipe", default="blockwise", choices=RECIPES)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    from bench.engine import model_for

    model_dir = model_for(run_dir, args.model_dir)
    from configs.schema import standalone_engine_config
    from rollout.engine import RolloutWorker

    loads = payloads(model_dir, args.recipe)
    engine = RolloutWorker(model_dir, standalone_engine_config(precision="fp8", fp8_recipe=args.recipe,
                                                               kv_cache_memory_bytes=16 << 20, max_model_len=256),
                           run_dir=run_dir)
    rows = []
    try:
        for name, weights in loads.items():
            engine.refit(weights)  # warm-up
            wire, refit = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                blob = pickle.dumps(weights, protocol=5)
                shipped = pickle.loads(blob)
                wire.append(time.perf_counter() - t0)
                refit.append(engine.refit(shipped))
            rows.append({"payload": name, "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
                         "pickle_ms": 1e3 * statistics.median(wire), "refit_ms": 1e3 * statistics.median(refit)})
    finally:
        engine.shutdown()
    base = next(r for r in rows if r["payload"] == "fp32")
    print(f"model {model_dir}; FP8 recipe {args.recipe}; median of {args.repeats}")
    print("| payload | bytes | vs fp32 | pickle+unpickle ms | engine refit ms | refit vs fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['payload']} | {r['bytes']:,} | {r['bytes'] / base['bytes']:.2f}x | {r['pickle_ms']:.1f} | "
              f"{r['refit_ms']:.1f} | {r['refit_ms'] / base['refit_ms']:.2f}x |")
    return rows


if __name__ == "__main__":
    main()
