"""Export the FP8 weights that were served during RL as a Hugging Face model directory.

    python -m tools.fp8_export export CHECKPOINT OUT [--recipe configs/<recipe>.yaml [key=value ...]]
                                                     [--layout fp8core|vllm] [--endpoint-url URL]

``CHECKPOINT`` is a checkpoint directory of a run (``<checkpoint_dir>/step_000020``, local, ``file://`` or
``s3://``) or the checkpoint root (the latest complete step is taken). The FP8 numerics come from the checkpoint's
``trainer_state.json`` (``rollout_fp8_spec``, written by the pipeline) or, for older checkpoints, from ``--recipe``
(its ``rollout_fp8_spec``). The FP32 masters of the checkpoint are quantized once, exactly as the trainer's
``FP8Linear`` and the rollout engine do (``fp8core.serve.served_state_dict``), and written with:

* ``--layout fp8core`` (default): ``quantization_config`` of this project's vLLM method (``rollout.vllm_fp8``; every
  recipe). vLLM with that method loads the FP8 codes + ``weight_scale_inv`` as they are (no re-quantization), so the
  engine serves exactly what the trainer trained against -- tested: same tokens and logprobs as an engine refit
  from the trainer.
* ``--layout vllm``: a layout vLLM's own kernels read, for GPU serving without this project's method. Those
  quantize activations with their own kernels, so serving is close to, not bit-identical with, the trainer's
  numerics.

  - blockwise: vLLM's native block FP8 (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
    ``weight_scale_inv``, BF16-kept layers in ``ignored_layers``). vLLM's CPU build cannot run it (its FP8 ops are
    CUDA kernels); ``--eval`` loads it with Hugging Face transformers' fine-grained FP8 loader instead (on a CPU it
    dequantizes the weights to BF16).
  - mxfp8: ModelOpt's MXFP8 (``quant_method: modelopt``, ``quant_algo: MXFP8``; ``weight_scale`` as the E8M0 bytes,
    uint8 ``[N, K/32]``; BF16-kept layers and ``lm_head`` in ``ignore``), which vLLM serves with its MXFP8 kernels
    (Blackwell; Marlin from SM80). ``--eval`` loads it with vLLM's own ModelOpt MXFP8 method; on a CPU, where vLLM
    lists no MXFP8 GEMM, through vLLM's emulation kernel (codes times scales in BF16 at load).

``--eval`` (with ``--recipe``, the run's recipe) then loads the export back with a loader that did not write it and
answers the validation prompts with it and with the checkpoint's own policy (``evaluate``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / torchao load

LAYOUTS = ("fp8core", "vllm")
VLLM_LAYOUTS = ("blockwise", "mxfp8")  # the recipes --layout vllm writes in a layout vLLM's own kernels read


def _split_checkpoint(uri: str) -> tuple[str, int | None]:
    import re

    m = re.search(r"^(.*)/step_(\d{6,})/?$", uri)
    return (m.group(1), int(m.group(2))) if m else (uri.rstrip("/"), None)


def quantization_config(spec, num_hidden_layers: int, layout: str) -> dict:
    """The ``quantization_config`` entry of the exported config.json."""
    if layout == "fp8core":
        from configs.schema import fp8_spec_keys
        from rollout.vllm_fp8 import quantization_config_dict

        return quantization_config_dict(num_hidden_layers=num_hidden_layers, **fp8_spec_keys(spec))
    if spec.recipe not in VLLM_LAYOUTS:
        raise ValueError(f"--layout vllm: vLLM's native FP8 layouts here are block FP8 (128x128, recipe blockwise) "
                         f"and MXFP8 (recipe mxfp8); the checkpoint's recipe is {spec.recipe!r} (use --layout "
                         "fp8core)")
    kept = sorted(set(range(num_hidden_layers)) - set(spec.layer_indices(num_hidden_layers)))
    if spec.recipe == "mxfp8":  # ModelOpt's MXFP8 (config.json form): BF16-kept layers and lm_head excluded
        return {"quant_method": "modelopt", "quant_algo": "MXFP8",
                "ignore": ["lm_head", *(f"model.layers.{i}.*" for i in kept)]}
    ignored = [f"model.layers.{i}.{sub}.{proj}" for i in kept for sub, projs in
               (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj",
                                                                                  "down_proj")))
               for proj in projs]
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
            "ignored_layers": ignored}


def export(checkpoint: str, out: str | Path, *, layout: str = "fp8core", recipe: str | None = None,
           overrides: list[str] | None = None, endpoint_url: str | None = None) -> Path:
    """Write the served FP8 model of ``checkpoint`` to ``out``; returns ``out``. Errors name the input at fault."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from fp8core.convert import convert_to_fp8
    from fp8core.serve import served_state_dict
    from fp8core.spec import FP8Spec
    from storage.checkpoint import CheckpointStore

    if layout not in LAYOUTS:
        raise ValueError(f"--layout {layout!r}: not one of {LAYOUTS}")
    root, step = _split_checkpoint(str(checkpoint))
    store = CheckpointStore(root, endpoint_url=endpoint_url)
    if step is None:
        step = store.latest_step()
        if step is None:
            raise ValueError(f"CHECKPOINT {checkpoint}: no complete checkpoint there")
    state = store.load_state(step)
    if state.get("rollout_fp8_spec"):
        spec = FP8Spec(**state["rollout_fp8_spec"])
    elif recipe:
        from configs.schema import load_config

        spec = load_config(recipe, overrides or []).rollout_fp8_spec()
        if spec is None:
            raise ValueError(f"--recipe {recipe}: policy.generation.vllm_cfg.precision is not fp8; nothing to export")
    else:
        raise ValueError(f"CHECKPOINT {store.step_uri(step)}: trainer_state.json has no rollout_fp8_spec (an older "
                         "checkpoint); pass --recipe with the run's recipe")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT {out}: exists and is not empty")
    with tempfile.TemporaryDirectory() as tmp:
        src = store.download_model(step, tmp)
        cfg = json.loads((src / "config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        convert_to_fp8(model, spec.linear_config(), num_first_layers_in_bf16=spec.num_first_layers_in_bf16,
                       num_last_layers_in_bf16=spec.num_last_layers_in_bf16)
        weights = served_state_dict(model, hp_dtype=torch.bfloat16)
        if layout == "vllm" and spec.recipe == "mxfp8":
            weights = _modelopt_mxfp8_names(weights)
        cfg["quantization_config"] = quantization_config(spec, int(cfg["num_hidden_layers"]), layout)
        cfg["dtype"] = "bfloat16"
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json", "manifest.json"):
                shutil.copy2(f, out / f.name)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt", "fp8_grpo_spec": json.dumps(asdict(spec)),
                            "fp8_grpo_checkpoint": store.step_uri(step)})
    return out


def _modelopt_mxfp8_names(served: dict) -> dict:
    """The served MXFP8 state in ModelOpt's layout: each E8M0 ``weight_scale_inv`` (one byte per 1x32 group, the
    dequantization scale ``2**(code - 127)``) as ``weight_scale`` in uint8, the dtype vLLM's MXFP8 layers hold."""
    import torch

    from fp8core.serve import SCALE_SUFFIX

    return {(k[:-len(SCALE_SUFFIX)] + "_scale" if k.endswith(SCALE_SUFFIX) else k):
            (t.view(torch.uint8) if k.endswith(SCALE_SUFFIX) else t) for k, t in served.items()}


EVAL_TEMPERATURE = 0.01  # near-greedy, as the flow's validation (vLLM clamps lower temperatures to 0.01)


def evaluate(checkpoint: str, out: str | Path, *, recipe: str, overrides: list[str] | None = None,
             eval_data: str | None = None, prompts: int = 200, endpoint_url: str | None = None,
             layout: str = "fp8core") -> dict:
    """Does the export serve what was trained? The export is loaded back by a loader that did not write it:
    ``--layout fp8core``: the rollout engine from the export directory, no refit; ``--layout vllm``: Hugging Face
    transformers' fine-grained FP8 loader (``quant_method: fp8``; on a machine without a GPU it dequantizes the FP8
    weights to BF16 and runs BF16 activations). A second engine serves the checkpoint's own policy (the trainer built
    from its FP32 masters, refit as in training). Both answer the same validation prompts (the same token ids)
    near-greedily; returns their accuracies with Wilson 95% CIs, the paired difference with its bootstrap CI, the
    share of identical responses, and the largest difference between the loaded weights and the trainer's served FP8
    weights (fp8core: the tensors themselves, codes and scales; vllm: the loader's weights against the trainer's
    codes times scales in FP32)."""
    import torch

    from configs.schema import EMBEDDED, load_config
    from data.loading import load_split, rows
    from data.prompt import PromptFormat
    from fp8core.serve import served_state_dict
    from rollout.engine import RolloutWorker
    from storage.checkpoint import CheckpointStore
    from trainer.policy import PolicyWorker

    if layout not in LAYOUTS:
        raise ValueError(f"--layout {layout!r}: not one of {LAYOUTS}")
    cfg = load_config(recipe, overrides or [])
    path = eval_data or cfg.data.validation_path
    if path == EMBEDDED:
        raise ValueError("--eval-data: the recipe's data.validation_path is the embedded set; pass the run's "
                         "validation file (e.g. runs/assets/addition/data/validation.jsonl)")
    ds = load_split(path, question_key=cfg.data.question_key, answer_key=cfg.data.answer_key)
    items = rows(ds, question_key=cfg.data.question_key, answer_key=cfg.data.answer_key,
                 indices=range(min(prompts, len(ds))), task=cfg.data.task)
    fmt, gen = PromptFormat.from_config(cfg.data), cfg.policy.generation
    root, step = _split_checkpoint(str(checkpoint))
    store = CheckpointStore(root, endpoint_url=endpoint_url)
    step = store.latest_step() if step is None else step

    def answer(engine) -> tuple[list[list[int]], list[dict]]:
        texts = engine.render_prompts(fmt, [(r["question"], r["task"]) for r in items])
        outs = engine.generate(texts, n=1, max_tokens=gen.max_new_tokens, temperature=EVAL_TEMPERATURE, seed=0)
        return [o["prompt_token_ids"] for o in outs], [o["samples"][0] for o in outs]

    with tempfile.TemporaryDirectory() as tmp:
        src = store.download_model(step, tmp)
        if layout == "fp8core":
            engine = RolloutWorker(out, cfg, run_dir=Path(tmp) / "export-engine")  # the export as it is: no refit
            try:
                exported = answer(engine)[1]
            finally:
                engine.shutdown()
        policy = PolicyWorker(src, cfg, run_dir=Path(tmp) / "policy")
        engine = RolloutWorker(src, cfg, run_dir=Path(tmp) / "policy-engine")
        try:
            engine.refit(policy.weights())
            prompt_ids, trained = answer(engine)
        finally:
            engine.shutdown()
        served = served_state_dict(policy.model, hp_dtype=torch.bfloat16)
    if layout == "fp8core":
        from safetensors.torch import load_file

        loaded = load_file(str(Path(out) / "model.safetensors"))
        reference = served
        loader = "the rollout engine (fp8core method), no refit"
    elif cfg.rollout_fp8_spec().recipe == "mxfp8":
        loaded, exported, loader = _vllm_mxfp8_answers(out, prompt_ids, gen.max_new_tokens, cfg)
        reference = _dequantized(served, "group32")
    else:
        loaded, exported, loader = _transformers_answers(out, prompt_ids, gen.max_new_tokens)
        reference = _dequantized(served, "block128")
    return {"prompts": len(items), "layout": layout, "loader": loader, **_compare_answers(items, exported, trained),
            **_compare_weights(reference, loaded)}


def _compare_answers(items: list[dict], exported: list[dict], trained: list[dict]) -> dict:
    """Accuracies of the export's and the policy's answers (Wilson 95% CIs), their paired difference (bootstrap CI)
    and the share of identical responses."""
    from fp8core.stats import accuracy_estimate, paired_bootstrap
    from rewards.verifiers import verify

    ok_e = [verify(r["task"], s["text"], r["answer"])[1] for r, s in zip(items, exported, strict=True)]
    ok_t = [verify(r["task"], s["text"], r["answer"])[1] for r, s in zip(items, trained, strict=True)]
    diff = paired_bootstrap([float(x) for x in ok_t], [float(x) for x in ok_e])
    return {"export": accuracy_estimate(ok_e).as_dict(), "policy": accuracy_estimate(ok_t).as_dict(),
            "export_minus_policy": diff.as_dict(),
            "same_responses": sum(a["text"] == b["text"] for a, b in zip(exported, trained, strict=True))
            / len(items)}


def _compare_weights(reference: dict, loaded: dict) -> dict:
    """The largest difference between the trainer's weights and the loader's, as they are and after rounding the
    trainer's to the loader's dtype (0 = the loader holds exactly them), and the keys only one side has."""
    both = [k for k in reference if k in loaded]
    return {"max_weight_diff": max(float((reference[k].float() - loaded[k].float()).abs().max()) for k in both),
            "max_weight_diff_in_loader_dtype": max(float((reference[k].to(loaded[k].dtype).float()
                                                          - loaded[k].float()).abs().max()) for k in both),
            "keys_not_in_both": sorted(set(reference) ^ set(loaded))}


def _dequantized(served: dict, granularity: str) -> dict:
    """The served state with every FP8 weight replaced by its codes times its scales (``granularity``) in FP32 (what
    the trainer's FP8 linear multiplies by) and the scale tensors dropped: the weights a dequantizing loader should
    hold, up to its own dtype."""
    from fp8core.quant import QuantizedTensor, dequantize
    from fp8core.serve import SCALE_SUFFIX

    out = {}
    for k, t in served.items():
        if k.endswith(SCALE_SUFFIX):
            continue
        scale = served.get(k + SCALE_SUFFIX)
        out[k] = t.float() if scale is None else dequantize(QuantizedTensor(t, scale.float(), granularity, "e4m3"))
    return out


def _vllm_mxfp8_answers(out: str | Path, prompt_ids: list[list[int]], max_new_tokens: int, cfg,
                        ) -> tuple[dict, list[dict], str]:
    """Load the MXFP8 ``--layout vllm`` export with vLLM's own ModelOpt MXFP8 method and answer ``prompt_ids``
    greedily. vLLM lists no MXFP8 GEMM for CPUs; there its own emulation kernel (``EmulationMxfp8LinearKernel``:
    the codes times the E8M0 scales in BF16 at load, BF16 activations) is registered for the CPU platform first.
    Returns the loaded weights under Hugging Face names (fused q/k/v and gate/up split), the answers and the loader
    in words."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.kernels.linear import _POSSIBLE_MXFP8_KERNELS, register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.platforms import current_platform

    from rollout.engine import _ProcessStateGuard

    how = "its MXFP8 kernels"
    if not current_platform.is_cuda():
        if EmulationMxfp8LinearKernel not in _POSSIBLE_MXFP8_KERNELS.get(current_platform._enum, []):
            register_linear_kernel(EmulationMxfp8LinearKernel, current_platform._enum, "mxfp8")
        how = "its emulation kernel on this CPU: codes x E8M0 scales in BF16 at load, BF16 activations"
    vc = cfg.policy.generation.vllm_cfg
    kwargs = {"kv_cache_memory_bytes": vc.kv_cache_memory_bytes} if vc.kv_cache_memory_bytes is not None else {}
    with _ProcessStateGuard():
        llm = LLM(model=str(out), dtype="bfloat16", max_model_len=vc.max_model_len, enforce_eager=True, seed=0,
                  enable_prefix_caching=False, **kwargs)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                            SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False)
        answers = [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outs]
        (weights,) = llm.apply_model(_hf_named_weights)  # one result per worker: one here
    finally:
        del llm
    return weights, answers, f"vLLM {vllm.__version__} ModelOpt MXFP8 ({how})"


def _hf_named_weights(model) -> dict:
    """A vLLM model's weights under Hugging Face names: fused parameters (``qkv_proj``, ``gate_up_proj``: the
    model's ``packed_modules_mapping``) split into their parts by the layer's output sizes, vocabulary rows padded
    by vLLM dropped."""
    import torch

    packed = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.nn.Parameter):
            continue
        w = w.data.detach().cpu()
        if getattr(mod, "org_vocab_size", None):  # embeddings / output projection
            w = w[:mod.org_vocab_size]
        head, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if leaf in packed:
            row = 0
            for part, size in zip(packed[leaf], mod.output_partition_sizes, strict=True):
                out[f"{head}.{part}.weight"] = w[row:row + size].clone()
                row += size
        else:
            out[f"{name}.weight"] = w.clone()
    return out


def _transformers_answers(out: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
                          batch: int = 32) -> tuple[dict, list[dict], str]:
    """Load the ``--layout vllm`` export with transformers' fine-grained FP8 loader and answer ``prompt_ids``
    greedily (batches, left padding). Returns the loaded weights by name, the answers (``token_ids`` up to and
    including EOS, ``text`` without special tokens) and the loader in words."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config

    gpu = torch.cuda.is_available()
    # without a GPU transformers dequantizes FP8 weights on load; say so rather than rely on its fallback warning
    kwargs = {} if gpu else {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, **kwargs).eval()
    if gpu:
        model = model.to("cuda")
    tok = AutoTokenizer.from_pretrained(str(out))
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [model.config.eos_token_id])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else min(eos)
    answers = []
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos),
                                 pad_token_id=pad)
        for row in gen[:, width:].tolist():
            toks = []
            for t in row:
                toks.append(t)
                if t in eos:
                    break
            answers.append({"token_ids": toks, "text": tok.decode(toks, skip_special_tokens=True)})
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    how = ("FP8 kernels on the GPU" if gpu else "FP8 weights dequantized to BF16 on load, BF16 activations")
    return weights, answers, f"transformers {__import__('transformers').__version__} fine-grained FP8 ({how})"


def _eval_lines(r: dict) -> str:
    def est(e):
        return f"{e['value']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"

    return (f"export parity on {r['prompts']} validation prompts (near-greedy): export {est(r['export'])} | "
            f"checkpoint's policy {est(r['policy'])} | export - policy {r['export_minus_policy']['value']:+.3f} "
            f"[{r['export_minus_policy']['lo']:+.3f}, {r['export_minus_policy']['hi']:+.3f}] | identical responses "
            f"{r['same_responses']:.1%} | largest weight difference {r['max_weight_diff']:.3g}"
            + (f" ({r['max_weight_diff_in_loader_dtype']:.3g} in the loader's dtype)"
               if r["layout"] == "vllm" else "")
            + f" | loaded by {r['loader']}"
            + (f" | tensors in one only: {', '.join(r['keys_not_in_both'][:5])}" if r["keys_not_in_both"] else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fp8_export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write the served FP8 weights of a checkpoint as an HF model dir")
    ex.add_argument("checkpoint")
    ex.add_argument("out")
    ex.add_argument("--layout", choices=LAYOUTS, default="fp8core")
    ex.add_argument("--recipe", help="the run's recipe (only for checkpoints without rollout_fp8_spec)")
    ex.add_argument("overrides", nargs="*", help="recipe overrides key=value (with --recipe)")
    ex.add_argument("--endpoint-url", help="S3 endpoint for s3:// checkpoints (credentials from the environment)")
    ex.add_argument("--eval", action="store_true",
                    help="after exporting, load the export back (fp8core: the rollout engine, no refit; vllm: "
                         "transformers' fine-grained FP8 loader, or vLLM's MXFP8 method for mxfp8), answer "
                         "validation prompts with it and with the checkpoint's own policy, and print both accuracies "
                         "with CIs and the largest weight difference (needs --recipe)")
    ex.add_argument("--eval-data", help="validation JSONL/Parquet for --eval (default: the recipe's data.validation_path)")
    ex.add_argument("--eval-prompts", type=int, default=200, help="validation prompts for --eval (default 200)")
    args = ap.parse_args(argv)
    if args.eval and not args.recipe:
        print("fp8_export: --eval needs --recipe (the run's recipe: the engine's settings and the validation set)",
              file=sys.stderr)
        return 2
    from storage.checkpoint import CheckpointError

    try:
        out = export(args.checkpoint, args.out, layout=args.layout, recipe=args.recipe, overrides=args.overrides,
                     endpoint_url=args.endpoint_url)
    except (ValueError, CheckpointError) as e:
        print(f"fp8_export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out} ({args.layout} layout)")
    if args.eval:
        try:
            r = evaluate(args.checkpoint, out, recipe=args.recipe, overrides=args.overrides, eval_data=args.eval_data,
                         prompts=args.eval_prompts, endpoint_url=args.endpoint_url, layout=args.layout)
        except (ValueError, CheckpointError) as e:
            print(f"fp8_export: {e}", file=sys.stderr)
            return 2
        print(_eval_lines(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
