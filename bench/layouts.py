"""Trainer memory per GPU rank, predicted for the GPU recipes' layouts (trainer.memory_model, the formula bench.memory
checks against measured CPU ranks): nothing here can run them, so this is the formula's prediction, not a measurement.

    .venv/bin/python -m bench.layouts configs/gpu/*.yaml
    .venv/bin/python -m bench.layouts configs/gpu/qwen3-30b-a3b-fp8-e2e.yaml --gpu-memory-gb 141 --no-results-doc

Per recipe: its model's shape (config.json from the Hugging Face cache when it holds the model, else the published
size fields in configs/gpu/model-shapes.json), ``cluster.policy_workers`` = M ranks, one update's micro-batches of
``policy.train_micro_batch_size`` x ``policy.max_total_sequence_length`` tokens (the longest a micro-batch can be),
BF16 activations under ``policy.precision: bfloat16``, FP8 GEMMs without a dequantized copy, FSDP2's one-layer
prefetch, with and without activation checkpointing. The resident FP32 master shard (4 P / M), which the CPU
measurement counts in its baseline, is added here, as is nothing for the CUDA context, the NCCL buffers and the
caching allocator's fragmentation (a GPU measurement's part). Stamped table: docs/results/memory-layouts.md."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "gpu" / "model-shapes.json"
GB = 1e9


def model_config(cfg) -> tuple[dict, str]:
    """The model's config.json fields and where they came from (the HF cache, else SHAPES)."""
    from configs.schema import ConfigError
    from storage.hub import resolve_config

    try:
        snap = resolve_config(cfg).get("policy.model_name")
    except ConfigError:
        snap = None
    if snap is not None:
        return json.loads((Path(snap.path) / "config.json").read_text()), f"HF cache {snap.pinned}"
    shapes = json.loads(SHAPES.read_text())
    if cfg.policy.model_name not in shapes:
        raise ValueError(f"policy.model_name: {cfg.policy.model_name!r} is neither in the Hugging Face cache nor in "
                         f"{shown(SHAPES)}")
    return shapes[cfg.policy.model_name], shown(SHAPES)


def predict(recipe: str, overrides: list[str], *, activation_checkpointing: bool) -> dict:
    from configs.schema import load_config
    from trainer.memory_model import ModelShape, predict_peak

    cfg = load_config(recipe, [*overrides, f"policy.megatron_cfg.activation_checkpointing="
                                           f"{str(activation_checkpointing).lower()}"])
    fields, source = model_config(cfg)
    shape = ModelShape.from_config(fields)
    p, world = cfg.policy, cfg.cluster.policy_workers
    rows = p.train_global_batch_size // world
    fp8 = cfg.trainer_fp8_spec()
    terms = predict_peak(shape, world=world, micro_batch_tokens=p.train_micro_batch_size * p.max_total_sequence_length,
                         micro_batches=math.ceil(rows / p.train_micro_batch_size),
                         fp8=None if fp8 is None else "native", activation_checkpointing=activation_checkpointing,
                         act_bytes=2 if p.precision == "bfloat16" else 4, prefetch=1)
    masters = 4 * shape.params / world
    return {"recipe": Path(recipe).stem, "model": p.model_name, "source": source, "params": shape.params,
            "world": world, "gpus_per_rank": cfg.ray.policy_worker.num_gpus, "activation_checkpointing":
            activation_checkpointing, "tokens": p.train_micro_batch_size * p.max_total_sequence_length,
            "terms": terms, "masters": masters, "total": terms["total"] + masters}


TERMS = ("optimizer", "gradients", "gathered_layers", "activations", "logits", "backward_transients")


def table(rows: list[dict], gpu_gb: float) -> str:
    lines = ["| recipe | model | M | checkpointing | tokens / micro-batch | master shard | "
             + " | ".join(t.replace("_", " ") for t in TERMS) + f" | total (GB) | fits {gpu_gb:g} GB |",
             "|---|---|---|---|---|---|" + "---|" * (len(TERMS) + 2)]
    for r in rows:
        t = r["terms"]
        lines.append(f"| {r['recipe']} | {r['model']} ({r['params'] / 1e9:.1f}B) | {r['world']} | "
                     f"{'on' if r['activation_checkpointing'] else 'off'} | {r['tokens']} | {r['masters'] / GB:.1f} | "
                     + " | ".join(f"{t[k] / GB:.1f}" for k in TERMS)
                     + f" | {r['total'] / GB:.1f} | {'yes' if r['total'] <= gpu_gb * GB else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipes", nargs="+", help="GPU recipes (configs/gpu/*.yaml)")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every recipe (repeatable), e.g. cluster.policy_workers=8")
    p.add_argument("--gpu-memory-gb", type=float, default=141.0, help="one GPU's memory (default: H200, 141 GB)")
    add_results_doc_args(p, "memory-layouts")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if not a.gpu_memory_gb > 0:
        p.error(f"--gpu-memory-gb: {a.gpu_memory_gb} must be > 0")
    origin = stamp("bench.layouts", argv)
    rows = []
    for recipe in a.recipes:
        for ac in (False, True):
            try:
                rows.append(predict(recipe, a.override, activation_checkpointing=ac))
            except (ValueError, OSError) as e:
                p.error(f"{recipe}: {str(e).splitlines()[0]}")
    out = table(rows, a.gpu_memory_gb)
    print(out)
    doc = results_doc(a)
    if doc:
        sources = sorted({f"{r['model']}: {r['source']}" for r in rows})
        details = [f"- model shapes: {'; '.join(sources)}",
                   "- a prediction (trainer.memory_model), not a measurement: per rank, GB = 1e9 bytes; the CUDA "
                   "context, NCCL buffers and allocator fragmentation are not included"]
        print(f"results: {shown(write_result('memory-layouts', 'Trainer memory per GPU rank, predicted', out, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
