"""GPU readiness check for the performance bench: FP8 GEMMs on the device vs fp8core's CPU emulation, FP8 / BF16
linear speed, quantize throughput. Needs only torch (no vLLM, no Transformer Engine); writes one JSON.

    bash bench/gpu_check.sh                                   # one H200: ~3-5 minutes
    .venv/bin/python bench/gpu_check.py --device cpu --quick --out /tmp/g.json   # the CPU-runnable parts (tests)

1. Agreement, every recipe x format (blockwise / rowwise / tensorwise x e4m3 / hybrid): forward, dX and dW of
   ``fp8core.fp8_linear`` with the device's ``scaled_mm`` backend against the FP32 emulation on the CPU, same
   inputs. Tolerance: max |device - emulation| <= 2e-3 x max |emulation| per output. Why 2e-3: the operands are the
   same FP8 values and scales (quantization is elementwise and exact on both sides), so only accumulation differs --
   Hopper's FP8 tensor cores accumulate in reduced precision inside a K-chunk (~2**-14 relative per chunk, DeepSeek-V3
   sec. 3.3.2) and fp8core sums 128-wide chunks in FP32; 2e-3 is ~30x that per-chunk error at K = 8192, and ~100x
   below what a wrong scale or layout gives (>= 1e-1).
2. torch 2.13's blockwise-scaled GEMM (``torch.nn.functional.scaled_mm`` with 1x128 activation and 128x128 weight
   scales: one GEMM instead of fp8core's one-per-128-chunk loop) where the device supports it: its agreement with
   the emulation (same tolerance) and its speed. Scale layouts are tried in turn; the JSON records which one ran.
3. Speed: linear fwd+bwd (y = x @ W.T, dX, dW) at 4096-8192 dims, FP8 (fp8core scaled_mm backend, and the blockwise
   scaled_mm forward alone where available) / BF16 ``F.linear``. The physical limit on Hopper is 0.5 (2x FP8 FLOPs).
4. quantize throughput (input bytes / s) per granularity vs a same-size copy, BF16 input.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8core.linear import fp8_linear  # noqa: E402
from fp8core.quant import GRANULARITIES, dequantize, quantize  # noqa: E402

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


def _blockwise_layouts(xs: torch.Tensor, ws: torch.Tensor):
    """Candidate scale layouts for F.scaled_mm blockwise (1x128 for A [M, K], 128x128 for B = W.T [K, N])."""
    yield "a[M,K/128] row-major, b[N/128,K/128]", xs.contiguous(), ws.contiguous()
    yield "a[M,K/128] outer-dim-major, b[N/128,K/128]", xs.t().contiguous().t(), ws.contiguous()
    yield "a outer-dim-major, b[K/128,N/128]", xs.t().contiguous().t(), ws.t().contiguous()
    yield "a row-major, b[K/128,N/128]", xs.contiguous(), ws.t().contiguous()


def blockwise_scaled_mm(device: torch.device, shape: tuple[int, int, int]) -> dict:
    """One-GEMM blockwise FP8 (1x128 x 128x128) forward vs the emulation, and its time vs BF16 F.linear."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return {"available": False, "reason": "torch.nn.functional.scaled_mm not in this torch"}
    t, k, n = shape
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    xq, wq = quantize(x, "group128"), quantize(w, "block128")
    ref = dequantize(xq) @ dequantize(wq).t()
    a8, b8 = xq.data.to(device), wq.data.to(device).t()
    errors = []
    for name, xs, ws in _blockwise_layouts(xq.scale.to(device), wq.scale.to(device)):
        try:
            def run(xs=xs, ws=ws):
                return F.scaled_mm(a8, b8, xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                                   output_dtype=torch.bfloat16)
            y = run()
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
            errors.append(f"{name}: {str(e)[:1200]}")
            continue
        rel = _rel(y.float(), ref)
        res = {"available": True, "layout": name, "rel_fwd": rel, "ok": rel <= max(TOLERANCE, 2**-8)}
        if device.type == "cuda":
            xb, wb = x.to(device, torch.bfloat16), w.to(device, torch.bfloat16)
            res["fwd_time_fp8_over_bf16"] = timeit(run, device) / timeit(lambda xb=xb, wb=wb: F.linear(xb, wb), device)
        if res["ok"]:
            return res
        errors.append(f"{name}: rel {rel:.3g} > tolerance")
    return {"available": False, "reason": "; ".join(errors)[:6000]}


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
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    if args.quick:
        agree_shapes, speed_shapes, q_shape, reps = [(256, 384, 256)], [(256, 256, 256)], (512, 512), 2
    else:
        agree_shapes = [(4096, 4096, 4096), (1024, 8192, 4096)]
        speed_shapes = [(4096, 4096, 4096), (8192, 4096, 8192), (8192, 8192, 8192)]
        q_shape, reps = (8192, 8192), 10
    backend = "scaled_mm"
    t0 = time.perf_counter()
    res = {"torch": torch.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
           "tolerance": TOLERANCE}
    res["agreement"] = [row for s in agree_shapes for row in agreement(device, s)]
    res["blockwise_scaled_mm"] = blockwise_scaled_mm(device, agree_shapes[0])
    res["linear_speed"] = linear_speed(device, speed_shapes, backend, reps)
    res["quantize"] = quantize_speed(device, q_shape, reps)
    res["all_agree"] = all(r["ok"] for r in res["agreement"])
    res["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for r in res["agreement"]:
        detail = r.get("error") or " ".join(f"{k}={r[k]:.2e}" for k in ("rel_fwd", "rel_dgrad", "rel_wgrad"))
        print(f"agreement {r['recipe']:10s} {r['fmt']:6s} {r['shape']}: {'ok' if r['ok'] else 'FAIL'} {detail}")
    print(f"blockwise scaled_mm: {res['blockwise_scaled_mm']}")
    for r in res["linear_speed"]:
        print(f"linear fwd+bwd {r['shape']}: BF16 {r['bf16_ms']:.2f} ms, FP8/BF16 "
              + ", ".join(f"{k[4:-9]} {v:.2f}" for k, v in r.items() if k.startswith("fp8_")))
    q = res["quantize"]
    print(f"quantize {q['shape']}: copy {q['copy_gbps']:.1f} GB/s, "
          + ", ".join(f"{g} {q[f'{g}_gbps']:.1f}" for g in GRANULARITIES))
    print(f"wrote {args.out} ({res['wall_s']:.0f} s); all recipes agree: {res['all_agree']}")
    return 0 if res["all_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
