"""FP8 numerics benchmark: quantize throughput and FP8-linear cost relative to BF16, measured side by side.

    .venv/bin/python bench/fp8_numerics.py                  # CPU: emulated FP8 (default; < ~1 min on 2 cores)
    .venv/bin/python bench/fp8_numerics.py --device cuda    # GPU with FP8 GEMMs: torch._scaled_mm at 4096-8192
                                                            # shapes + agreement with the CPU emulation

Table 1: quantize GB/s (input bytes / time) per granularity next to a plain copy (``clone``) of the same bytes.
Table 2: linear fwd+bwd (y = x @ W.T, then dX and dW) time per recipe divided by the BF16 ``F.linear`` time.
On CPU the FP8 path is the emulation (quantize -> dequantize -> FP32 matmul), so the ratio is the emulation's
overhead, not an FP8 speed-up; on CUDA it is ``torch._scaled_mm`` with K-chunked blockwise scaling.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8core import GRANULARITIES, fp8_linear, fp8_linear_forward, quantize, weight_granularity  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device: torch.device, *, min_time: float = 0.3, max_reps: int = 50) -> float:
    """Median seconds per call after one warm-up call, repeating until ``min_time`` (at most ``max_reps``)."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_quantize(device: torch.device, shape: tuple[int, int]) -> list[str]:
    x = torch.randn(shape, dtype=torch.bfloat16, device=device)
    nbytes = x.numel() * x.element_size()
    copy_s = timeit(lambda: x.clone(), device)
    rows = [f"| copy (clone) | {nbytes / copy_s / 1e9:.2f} | 1.00 |"]
    for g in GRANULARITIES:
        s = timeit(lambda g=g: quantize(x, g), device)
        rows.append(f"| quantize {g} | {nbytes / s / 1e9:.2f} | {s / copy_s:.1f} |")
    return rows


def _fwd_bwd(x, w, dy, fn):
    def run():
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        fn(xx, ww).backward(dy)
    return run


def bench_linear(device: torch.device, shapes, recipes, backend: str) -> list[str]:
    rows = []
    for t, k, n in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(t, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16)
        dy = torch.randn(t, n, generator=g).to(device, torch.bfloat16)
        bf16_s = timeit(_fwd_bwd(x, w, dy, F.linear), device)
        fp32_s = timeit(_fwd_bwd(x.float(), w.float(), dy.float(), F.linear), device)
        cells = [f"{bf16_s * 1e3:.1f}", f"{fp32_s / bf16_s:.2f}"]
        for r in recipes:
            s = timeit(_fwd_bwd(x, w, dy, lambda a, b, r=r: fp8_linear(a, b, recipe=r, backend=backend)), device)
            cells.append(f"{s / bf16_s:.2f}")
        rows.append(f"| {t}x{k} -> {n} | " + " | ".join(cells) + " |")
    return rows


def gpu_agreement(device: torch.device, shapes, recipes) -> list[str]:
    """Forward (and dX/dW on the first shape) of scaled_mm on the GPU vs the emulation on the CPU, same inputs."""
    rows = []
    for i, (t, k, n) in enumerate(shapes):
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(t, k, generator=g, dtype=torch.float32)
        w = torch.randn(n, k, generator=g) / k**0.5
        dy = torch.randn(t, n, generator=g)
        for r in recipes:
            wq = quantize(w, weight_granularity(r))
            y_cpu = fp8_linear_forward(x, wq, recipe=r, backend="emulated")
            y_gpu = fp8_linear_forward(x.to(device), wq.to(device), recipe=r, backend="scaled_mm").cpu()
            worst = ((y_gpu - y_cpu).abs().max() / y_cpu.abs().max()).item()
            cell = f"| {t}x{k} -> {n} | {r} | fwd max rel diff {worst:.2e}"
            if i == 0:
                grads = []
                for dev, be in (("cpu", "emulated"), (device, "scaled_mm")):
                    xx = x.to(dev).requires_grad_()
                    ww = w.to(dev).requires_grad_()
                    fp8_linear(xx, ww, recipe=r, backend=be).backward(dy.to(dev))
                    grads.append((xx.grad.cpu(), ww.grad.cpu()))
                for name, a, b in (("dX", grads[0][0], grads[1][0]), ("dW", grads[0][1], grads[1][1])):
                    cell += f"; {name} {((a - b).abs().max() / a.abs().max()).item():.2e}"
            rows.append(cell + " |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads for the CPU run (default 1: stable on a shared 2-core box; 0 = torch's)")
    args = p.parse_args(argv)
    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    recipes = ["blockwise", "rowwise", "tensorwise"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# fp8core numerics bench: torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f", {torch.get_num_threads()} threads, load average {load:.1f}"))
    if device.type == "cuda":
        q_shape, backend = (8192, 8192), "scaled_mm"
        shapes = [(4096, 4096, 4096), (8192, 4096, 8192), (8192, 8192, 8192)]
    else:
        q_shape, backend = (2048, 4096), "emulated"
        shapes = [(512, 256, 512), (512, 1024, 4096)]
    print(f"\n## quantize, bf16 input {q_shape[0]}x{q_shape[1]} ({q_shape[0] * q_shape[1] * 2 / 1e6:.0f} MB)\n")
    print("| op | GB/s | time / copy |\n|---|---|---|")
    print("\n".join(bench_quantize(device, q_shape)))
    print(f"\n## linear fwd+bwd, tokens x in -> out; FP8 backend {backend}; ratios are time / BF16 time\n")
    print("| shape | BF16 ms | FP32 / BF16 | " + " | ".join(f"FP8 {r} / BF16" for r in recipes) + " |")
    print("|---" * (3 + len(recipes)) + "|")
    print("\n".join(bench_linear(device, shapes, recipes, backend)))
    if device.type == "cuda":
        print("\n## agreement: GPU scaled_mm vs CPU emulation (same inputs, FP32 in/out)\n")
        print("| shape | recipe | max |diff| / max |ref| |\n|---|---|---|")
        print("\n".join(gpu_agreement(device, [(4096, 4096, 4096), (8192, 8192, 8192)][:1] + [(1024, 8192, 4096)],
                                      recipes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
