"""Trainer memory per GPU rank and rollout-engine memory per GPU, predicted for the GPU recipes' layouts
(trainer.memory_model: the trainer formula bench.memory checks against measured CPU ranks, the engine's weights as
the tiny engines' FP8 layers measure them): nothing here can run them, so this is the formulas' prediction, not a
measurement. Each table says whether the recipe fits an H100 (80 GB) and an H200 (141 GB).

    .venv/bin/python -m bench.layouts configs/gpu/*.yaml
    .venv/bin/python -m bench.layouts configs/gpu/qwen3-30b-a3b-fp8-e2e.yaml --gpu-memory-gb 141 --no-results-doc

Per recipe: its model's shape (config.json from the Hugging Face cache when it holds the model, else the published
size fields in configs/gpu/model-shapes.json), ``cluster.policy_workers`` = M ranks, one update's micro-batches of
``policy.train_micro_batch_size`` x ``policy.max_total_sequence_length`` tokens (the longest a micro-batch can be),
under ``policy.precision: bfloat16`` the activations BF16 autocast casts (the rest FP32: trainer.memory_model), FP8 GEMMs without a dequantized copy, FSDP2's one-layer
prefetch, with and without activation checkpointing. The resident FP32 master shard (4 P / M), which the CPU
measurement counts in its baseline, is added here, as is nothing for the CUDA context, the NCCL buffers and the
caching allocator's fragmentation (a GPU measurement's part). The engine: its weights (FP8 decoder linears 1 B per
parameter + block scales, the rest BF16, routers FP32), vLLM's budget (``gpu_memory_utilization`` x the GPU) and the
KV-cache tokens the rest holds at the recipe's ``kv_cache_dtype``: how many full-length (``max_model_len``) sequences
it runs at once, of ``max_num_seqs``; it fits where that is at least one. Stamped table: docs/results/memory-layouts.md."""

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
                         autocast=p.precision == "bfloat16", prefetch=1)
    masters = 4 * shape.params / world
    return {"recipe": Path(recipe).stem, "model": p.model_name, "source": source, "params": shape.params,
            "world": world, "gpus_per_rank": cfg.ray.policy_worker.num_gpus, "activation_checkpointing":
            activation_checkpointing, "tokens": p.train_micro_batch_size * p.max_total_sequence_length,
            "terms": terms, "masters": masters, "total": terms["total"] + masters}


TERMS = ("optimizer", "gradients", "gathered_layers", "activations", "logits", "backward_transients")


def table(rows: list[dict], gpus_gb: list[float]) -> str:
    lines = ["| recipe | model | M | checkpointing | tokens / micro-batch | master shard | "
             + " | ".join(t.replace("_", " ") for t in TERMS) + " | total (GB) | "
             + " | ".join(f"fits {g:g} GB" for g in gpus_gb) + " |",
             "|---|---|---|---|---|---|" + "---|" * (len(TERMS) + 1 + len(gpus_gb))]
    for r in rows:
        t = r["terms"]
        lines.append(f"| {r['recipe']} | {r['model']} ({r['params'] / 1e9:.1f}B) | {r['world']} | "
                     f"{'on' if r['activation_checkpointing'] else 'off'} | {r['tokens']} | {r['masters'] / GB:.1f} | "
                     + " | ".join(f"{t[k] / GB:.1f}" for k in TERMS) + f" | {r['total'] / GB:.1f} | "
                     + " | ".join("yes" if r["total"] <= g * GB else "no" for g in gpus_gb) + " |")
    return "\n".join(lines)


def predict_engines(recipe: str, overrides: list[str], gpus_gb: list[float]) -> list[dict]:
    """The recipe's rollout engine on each GPU size (trainer.memory_model.predict_engine)."""
    from configs.schema import load_config
    from fp8core.convert import fp8_layer_indices
    from rollout.kv_cache import kv_bytes_per_token
    from trainer.memory_model import ModelShape, predict_engine

    cfg = load_config(recipe, overrides)
    fields, _ = model_config(cfg)
    shape = ModelShape.from_config(fields)
    vc = cfg.policy.generation.vllm_cfg
    spec = cfg.rollout_fp8_spec() if vc.precision == "fp8" else None
    fp8_layers = 0 if spec is None else len(fp8_layer_indices(shape.layers, spec.num_first_layers_in_bf16,
                                                              spec.num_last_layers_in_bf16))
    per_token = kv_bytes_per_token(fields, "fp8" if vc.kv_fp8 else "auto")
    return [{"recipe": Path(recipe).stem, "gpu_gb": g, "utilization": vc.gpu_memory_utilization,
             "kv_dtype": vc.kv_cache_dtype, "max_model_len": vc.max_model_len, "max_num_seqs": vc.max_num_seqs, "fp8_layers": fp8_layers, "layers": shape.layers,
             **predict_engine(shape, fp8_layers=fp8_layers, kv_bytes_per_token=per_token, gpu_bytes=g * GB,
                              utilization=vc.gpu_memory_utilization,
                              recipe=spec.recipe if spec else "blockwise")} for g in gpus_gb]


def predict_refits(recipe: str, overrides: list[str]) -> dict:
    """The recipe's refit, both transports (trainer.memory_model.predict_refit)."""
    from configs.schema import load_config
    from fp8core.convert import fp8_layer_indices
    from trainer.memory_model import ModelShape, predict_refit

    cfg = load_config(recipe, overrides)
    shape = ModelShape.from_config(model_config(cfg)[0])
    spec = cfg.rollout_fp8_spec() if cfg.policy.generation.vllm_cfg.precision == "fp8" else None
    fp8_layers = 0 if spec is None else len(fp8_layer_indices(shape.layers, spec.num_first_layers_in_bf16,
                                                              spec.num_last_layers_in_bf16))
    n, m = cfg.cluster.rollout_workers, cfg.cluster.policy_workers
    return {"recipe": Path(recipe).stem, "engines": n, "trainers": m,
            **predict_refit(shape, fp8_layers=fp8_layers, engines=n, trainers=m,
                            recipe=spec.recipe if spec else "blockwise")}


def refit_table(rows: list[dict]) -> str:
    lines = ["| recipe | engines x trainers | served S (GB) | largest bucket (GB) | transport | moved per refit (GB) | "
             "added per trainer rank (GB) | added per engine (GB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for t in ("collective", "object_store"):
            lines.append(f"| {r['recipe']} | {r['engines']} x {r['trainers']} | {r['served'] / GB:.1f} | "
                         f"{r['largest_bucket'] / GB:.2f} | {t} | {r[f'moved_{t}'] / GB:.1f} | "
                         f"{r[f'trainer_{t}'] / GB:.2f} | {r[f'engine_{t}'] / GB:.2f} |")
    return "\n".join(lines)


def engine_table(rows: list[dict]) -> str:
    lines = ["| recipe | GPU (GB) | FP8 layers | weights (GB) | vLLM budget (GB) | KV room (GB) | KV cache | KV tokens | "
             "full-length sequences at once (of max_num_seqs) | fits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at_once = int(r["kv_tokens"] // r["max_model_len"])
        lines.append(f"| {r['recipe']} | {r['gpu_gb']:g} | {r['fp8_layers']} of {r['layers']} | {r['weights'] / GB:.1f} "
                     f"| {r['budget'] / GB:.1f} ({r['utilization']:g}) | {r['kv_room'] / GB:.1f} | {r['kv_dtype']} | "
                     f"{r['kv_tokens']:,.0f} | {min(at_once, r['max_num_seqs'])} ({r['max_num_seqs']}) | "
                     f"{'yes' if at_once >= 1 else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipes", nargs="+", help="GPU recipes (configs/gpu/*.yaml)")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every recipe (repeatable), e.g. cluster.policy_workers=8")
    p.add_argument("--gpu-memory-gb", type=float, action="append", default=None,
                   help="one GPU's memory (repeatable; default: 80 and 141, an H100 and an H200)")
    add_results_doc_args(p, "memory-layouts")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    gpus = a.gpu_memory_gb or [80.0, 141.0]
    if not all(g > 0 for g in gpus):
        p.error(f"--gpu-memory-gb: {gpus} must all be > 0")
    origin = stamp("bench.layouts", argv)
    rows, engines, refits = [], [], []
    for recipe in a.recipes:
        try:
            for ac in (False, True):
                rows.append(predict(recipe, a.override, activation_checkpointing=ac))
            engines += predict_engines(recipe, a.override, gpus)
            refits.append(predict_refits(recipe, a.override))
        except (ValueError, OSError) as e:
            p.error(f"{recipe}: {str(e).splitlines()[0]}")
    out = ("Trainer, per rank:\n\n" + table(rows, gpus) + "\n\nRollout engine, per GPU (one engine per GPU):\n\n"
           + engine_table(engines) + "\n\nOne refit (cluster.refit_transport), bytes and what it adds per process "
           "(bench.refit measures them on CPU at 2.9M-103M; seconds are not extrapolated):\n\n" + refit_table(refits))
    print(out)
    doc = results_doc(a)
    if doc:
        sources = sorted({f"{r['model']}: {r['source']}" for r in rows})
        details = [f"- model shapes: {'; '.join(sources)}",
                   "- a prediction (trainer.memory_model), not a measurement: per rank / per engine, GB = 1e9 bytes; "
                   "the CUDA context, NCCL buffers and allocator fragmentation are not included, nor vLLM's "
                   "activation workspace and CUDA graphs (taken from its budget before the KV cache)"]
        print(f"results: {shown(write_result('memory-layouts', 'Trainer and engine memory per GPU, predicted', out, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
