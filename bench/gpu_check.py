"""GPU readiness check: the trainer's FP8 GEMMs and quantizer on the device against fp8core's CPU reference, which
GEMM path ran, FP8 / BF16 linear speed, quantize throughput, and one FP8 training step of the tiny model. Needs only
torch and transformers (no vLLM, Ray or Prefect); written for torch 2.11 as well as the project's pin (the one-call
blockwise GEMM, new in torch's functional API, is used only where torch has it; not yet run on 2.11); writes one JSON.

    bash bench/gpu_check.sh                                   # one H100 / H200: expected 2-4 minutes (not run yet)
    .venv/bin/python bench/gpu_check.py --device cpu --quick --out /tmp/g.json   # the CPU-runnable parts (tests)

0. Versions: torch, its CUDA, the driver, the device and its capability, whether torch has the one-call blockwise
   GEMM (``torch.nn.functional.scaled_mm``).
1. Agreement, every recipe x format (blockwise / rowwise / tensorwise x e4m3 / hybrid): forward, dX and dW of
   ``fp8core.fp8_linear`` with the device's ``scaled_mm`` backend against the FP32 emulation on the CPU, same
   inputs. Tolerance: max |device - emulation| <= 2e-3 x max |emulation| per output. Why 2e-3: the operands are the
   same FP8 values and scales (quantization is elementwise and exact on both sides), so only accumulation differs --
   Hopper's FP8 tensor cores accumulate in reduced precision inside a K block (~2**-14 relative, DeepSeek-V3 sec.
   3.3.2) and the block-scaled GEMM adds 128-wide blocks in FP32; 2e-3 is ~30x that error at K = 8192, and ~100x
   below what a wrong scale or layout gives (>= 1e-1).
2. Which path each GEMM took (``fp8core.scaled_mm.paths``): blockwise E4M3 as one call of torch's blockwise GEMM or,
   where torch said it is unsupported, one call per 128-wide K chunk (and why); rowwise with FP32 output or scaled by
   hand. The blockwise call's own agreement and speed: the trainer's three blockwise GEMMs (forward, dgrad, wgrad)
   through ``fp8core.linear.fp8_mm`` against the emulation, and the forward's time against BF16 ``F.linear``.
3. The quantizer off the CPU (``fp8core.quant.quantize_on_device``): its codes and scales against the CPU
   quantizer's, bit for bit, every granularity and format.
4. Speed: linear fwd+bwd (y = x @ W.T, dX, dW) at 4096-8192 dims, FP8 (fp8core scaled_mm backend) / BF16
   ``F.linear``. The physical limit on Hopper is 0.5 (2x FP8 FLOPs). Quantize throughput (input bytes / s) per
   granularity vs a same-size copy, BF16 input.
5. One training step of the embedded tiny model's architecture (Qwen3, random weights) with its decoder linears in
   FP8 (``fp8core.convert``, blockwise, ``scaled_mm``) and the trainer's GRPO loss (``fp8core.rl``): loss and
   gradients finite, and its time against the same step in FP32 and under BF16 autocast.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8core import scaled_mm  # noqa: E402
from fp8core.linear import fp8_linear, fp8_mm  # noqa: E402
from fp8core.quant import GRANULARITIES, dequantize, quantize, quantize_columns, quantize_on_device  # noqa: E402

TOLERANCE = 2e-3  # max |device - emulation| / max |emulation| (module docstring)
RECIPES = ("blockwise", "rowwise", "tensorwise")
FORMATS = ("e4m3", "hybrid")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device: torch.device, *, reps: int = 10) -> float:
    """Median seconds per call after two warm-up calls."""
    fn()
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double().cpu() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def _grads(x, w, dy, device, backend, recipe, fmt):
    xx = x.to(device).requires_grad_()
    ww = w.to(device).requires_grad_()
    y = fp8_linear(xx, ww, recipe=recipe, fmt=fmt, backend=backend)
    y.backward(dy.to(device))
    return y.detach().cpu(), xx.grad.cpu(), ww.grad.cpu()


def agreement(device: torch.device, shape: tuple[int, int, int]) -> list[dict]:
    """Device scaled_mm backend vs CPU emulation, fwd / dX / dW, every recipe and format."""
    t, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(t, n, generator=g)
    out = []
    for recipe in RECIPES:
        for fmt in FORMATS:
            ref = _grads(x, w, dy, torch.device("cpu"), "emulated", recipe, fmt)
            try:
                got = _grads(x, w, dy, device, "scaled_mm", recipe, fmt)
            except (RuntimeError, NotImplementedError, ValueError) as e:
                out.append({"recipe": recipe, "fmt": fmt, "shape": list(shape), "error": repr(e)[:300], "ok": False})
                continue
            rel = {name: _rel(a, b) for name, a, b in zip(("fwd", "dgrad", "wgrad"), got, ref, strict=True)}
            out.append({"recipe": recipe, "fmt": fmt, "shape": list(shape), **{f"rel_{k_}": v for k_, v in rel.items()},
                        "ok": all(v <= TOLERANCE for v in rel.values())})
    return out


def blockwise_gemms(device: torch.device, shape: tuple[int, int, int]) -> dict:
    """The trainer's three blockwise E4M3 GEMMs (forward, dgrad, wgrad) through fp8core.linear.fp8_mm on the device
    against the emulation, the path they took, and the forward's time against BF16 F.linear."""
    t, k, n = shape
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(t, n, generator=g)
    wq = quantize(w, "block128")
    forms = {"fwd": (quantize(x, "group128"), wq), "dgrad": (quantize(dy, "group128"), wq.t()),
             "wgrad": (quantize_columns(dy, "group128"), quantize_columns(x, "group128"))}
    res = {"available": scaled_mm.blockwise_in_torch()}
    for name, (a, b) in forms.items():
        ref = dequantize(a) @ dequantize(b).t()
        da, db = a.to(device), b.to(device)
        try:
            got = fp8_mm(da, db, backend="scaled_mm")
        except (RuntimeError, NotImplementedError, ValueError) as e:
            res[f"{name}_error"] = repr(e)[:600]
            continue
        res[f"rel_{name}"] = _rel(got, ref)
    res["path"] = scaled_mm.paths(device)["blockwise_e4m3"]
    res["ok"] = all(res.get(f"rel_{f}", 1.0) <= TOLERANCE for f in forms)
    if device.type == "cuda":
        a, b = (q.to(device) for q in forms["fwd"])
        xb, wb = x.to(device, torch.bfloat16), w.to(device, torch.bfloat16)
        res["fwd_time_fp8_over_bf16"] = (timeit(lambda: fp8_mm(a, b, backend="scaled_mm"), device)
                                         / timeit(lambda: F.linear(xb, wb), device))
    return res


def quantizer_bits(device: torch.device, shape: tuple[int, int]) -> list[dict]:
    """quantize on the device (the path without host reads) against the CPU quantizer: codes and scales bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[1])
    out = []
    for gran in GRANULARITIES:
        for fmt in ("e4m3", "e5m2"):
            want = quantize(x, gran, fmt=fmt)
            got = quantize_on_device(x.to(device), gran, fmt=fmt)
            same = (torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
                    and torch.equal(got.scale.cpu().view(torch.int32), want.scale.view(torch.int32)))
            out.append({"granularity": gran, "fmt": fmt, "bit_identical": bool(same)})
    return out


TINY = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # embedded.tiny_model.TinyModelSpec


def tiny_train_step(device: torch.device, *, batch: int, seq: int, reps: int) -> dict:
    """One GRPO step (forward, the trainer's clipped loss, backward, AdamW) of the tiny model's architecture with its
    decoder linears in FP8 (scaled_mm backend), against FP32 and BF16 autocast: finite loss and gradients, seconds."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8core.convert import convert_to_fp8
    from fp8core.linear import FP8LinearConfig
    from fp8core.rl import clipped_pg_loss

    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, TINY["vocab_size"], (batch, seq), generator=g).to(device)
    adv = torch.randn(batch, generator=g).to(device)
    mask = torch.ones(batch, seq - 1, device=device)
    res = {"batch": batch, "seq": seq}
    for arm in ("fp8", "fp32", "bf16_autocast"):
        torch.manual_seed(0)
        cfg = Qwen3Config(**TINY, max_position_embeddings=512, tie_word_embeddings=False)
        model = Qwen3ForCausalLM(cfg).to(device, torch.float32)
        if arm == "fp8":
            res["fp8_linears"] = len(convert_to_fp8(model, FP8LinearConfig(recipe="blockwise", backend="scaled_mm")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        finite = []

        def step(model=model, opt=opt, arm=arm, finite=finite):
            ctx = torch.autocast(device.type, dtype=torch.bfloat16) if arm == "bf16_autocast" else contextlib.nullcontext()
            with ctx:
                logits = model(tokens).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
            loss, _ = clipped_pg_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28)
            loss.backward()
            finite.append(bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p.grad).all())
                                                              for p in model.parameters() if p.grad is not None))
            opt.step()
            opt.zero_grad(set_to_none=True)

        res[f"{arm}_step_s"] = timeit(step, device, reps=reps)
        res[f"{arm}_finite"] = all(finite)
    res["fp8_over_fp32"] = res["fp8_step_s"] / res["fp32_step_s"]
    res["fp8_over_bf16_autocast"] = res["fp8_step_s"] / res["bf16_autocast_step_s"]
    return res


def versions(device: torch.device) -> dict:
    """torch, its CUDA, the driver (nvidia-smi), the device, and whether torch has the one-call blockwise GEMM."""
    import shutil
    import subprocess

    res = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": str(device),
           "blockwise_scaled_mm_in_torch": scaled_mm.blockwise_in_torch()}
    if device.type == "cuda":
        res["device_name"] = torch.cuda.get_device_name(device)
        res["capability"] = list(torch.cuda.get_device_capability(device))
        if shutil.which("nvidia-smi"):
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            res["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    return res


def linear_speed(device: torch.device, shapes, backend: str, reps: int) -> list[dict]:
    out = []
    for t, k, n in shapes:
        g = torch.Generator().manual_seed(2)
        x = torch.randn(t, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16)
        dy = torch.randn(t, n, generator=g).to(device, torch.bfloat16)

        def fb(fn, x=x, w=w, dy=dy):
            def run():
                xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
                fn(xx, ww).backward(dy)
            return run

        bf16 = timeit(fb(F.linear), device, reps=reps)
        row = {"shape": [t, k, n], "bf16_ms": bf16 * 1e3}
        for recipe in RECIPES:
            s = timeit(fb(lambda a, b, r=recipe: fp8_linear(a, b, recipe=r, backend=backend)), device, reps=reps)
            row[f"fp8_{recipe}_over_bf16"] = s / bf16
        out.append(row)
    return out


def quantize_speed(device: torch.device, shape, reps: int) -> dict:
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    res = {"shape": list(shape), "copy_gbps": nbytes / timeit(lambda: x.clone(), device, reps=reps) / 1e9}
    for gran in GRANULARITIES:
        res[f"{gran}_gbps"] = nbytes / timeit(lambda g=gran: quantize(x, g), device, reps=reps) / 1e9
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="small shapes (the CPU test)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "runs" / "bench" / "gpu_check.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU-only build'}) at "
              f"{sys.executable} sees no CUDA device", file=sys.stderr)
        return 2
    if args.quick:
        agree_shapes, speed_shapes, q_shape, reps = [(256, 384, 256)], [(256, 256, 256)], (512, 512), 2
        step = {"batch": 2, "seq": 16, "reps": 1}
    else:
        agree_shapes = [(4096, 4096, 4096), (1024, 8192, 4096)]
        speed_shapes = [(4096, 4096, 4096), (8192, 4096, 8192), (8192, 8192, 8192)]
        q_shape, reps = (8192, 8192), 10
        step = {"batch": 16, "seq": 256, "reps": 5}
    t0 = time.perf_counter()
    res = {**versions(device), "tolerance": TOLERANCE}
    print(f"gpu_check: torch {res['torch']} (CUDA {res['torch_cuda']}), driver {res.get('driver')}, "
          f"{res.get('device_name', 'cpu')} {res.get('capability')}; one-call blockwise GEMM in torch: "
          f"{res['blockwise_scaled_mm_in_torch']}", flush=True)
    res["agreement"] = [row for s in agree_shapes for row in agreement(device, s)]
    res["blockwise_gemms"] = blockwise_gemms(device, agree_shapes[0])
    res["paths"] = scaled_mm.paths(device)
    res["quantizer_bits"] = quantizer_bits(device, q_shape)
    res["linear_speed"] = linear_speed(device, speed_shapes, "scaled_mm", reps)
    res["quantize"] = quantize_speed(device, q_shape, reps)
    res["tiny_train_step"] = tiny_train_step(device, **step)
    res["all_agree"] = (all(r["ok"] for r in res["agreement"]) and res["blockwise_gemms"]["ok"]
                        and all(r["bit_identical"] for r in res["quantizer_bits"])
                        and all(res["tiny_train_step"][f"{a}_finite"] for a in ("fp8", "fp32", "bf16_autocast")))
    res["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for r in res["agreement"]:
        detail = r.get("error") or " ".join(f"{k}={r[k]:.2e}" for k in ("rel_fwd", "rel_dgrad", "rel_wgrad"))
        print(f"agreement {r['recipe']:10s} {r['fmt']:6s} {r['shape']}: {'ok' if r['ok'] else 'FAIL'} {detail}")
    print(f"paths: {res['paths']}")
    print(f"blockwise GEMMs: {res['blockwise_gemms']}")
    bad = [f"{r['granularity']}/{r['fmt']}" for r in res["quantizer_bits"] if not r["bit_identical"]]
    print(f"quantizer on the device = CPU quantizer, bit for bit: {'all' if not bad else 'NOT ' + ', '.join(bad)}")
    for r in res["linear_speed"]:
        print(f"linear fwd+bwd {r['shape']}: BF16 {r['bf16_ms']:.2f} ms, FP8/BF16 "
              + ", ".join(f"{k[4:-len('_over_bf16')]} {v:.2f}" for k, v in r.items() if k.startswith("fp8_")))
    q = res["quantize"]
    print(f"quantize {q['shape']}: copy {q['copy_gbps']:.1f} GB/s, "
          + ", ".join(f"{g} {q[f'{g}_gbps']:.1f}" for g in GRANULARITIES))
    ts = res["tiny_train_step"]
    print(f"tiny model train step ({ts['fp8_linears']} FP8 linears): FP8 {ts['fp8_step_s'] * 1e3:.1f} ms, "
          f"FP32 {ts['fp32_step_s'] * 1e3:.1f} ms, BF16 autocast {ts['bf16_autocast_step_s'] * 1e3:.1f} ms; finite: "
          f"{ts['fp8_finite']}")
    print(f"wrote {args.out} ({res['wall_s']:.0f} s); all checks pass: {res['all_agree']}")
    return 0 if res["all_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
