"""What bounds the FP8 engine's rollout on a CPU: the GEMMs an FP8 linear can run on, side by side.

    .venv/bin/python -m bench.gemm                          # the ~25M model's linears, decode and prefill rows,
                                                            # and decode rows at 1024 -> 4096 (an 8 MB BF16 weight)
    .venv/bin/python -m bench.gemm --shapes 2560x512x1792 --no-results-doc

For each shape (tokens M x in-features K x out-features N), median wall time over ``--repeats`` calls, with the
process's threads, of:

* ``fp8 cpu op linear``: fp8core.linear.fp8_linear_forward_cpu on the CPU FP8 GEMM (fp8core.gemm) with the weight
  already quantized and packed -- the call the trainer's FP8Linear and the vLLM plugin make on a CPU (the
  activation quantized inside the op, straight into its packed layout, + cast), where fp8core/csrc built;
* ``fp8 emulated linear``: fp8core.linear.fp8_linear_forward_emulated with the weight already dequantized -- the
  call before the CPU op (activation quantize-dequantize + the FP32 GEMM + cast);
* ``fp32 gemm``: that call's GEMM alone (FP32 operands holding FP8 values times their scales);
* ``bf16 linear``: torch's BF16 linear on the CPU's BF16 units (AMX / AVX-512 BF16 where present), what vLLM's BF16
  engine runs; its output is rounded to BF16;
* ``onednn fp8``: torch.ops.onednn.qlinear_pointwise on E4M3 codes with FP32 output, one per-tensor activation scale
  and per-channel weight scales -- the only FP8 GEMM torch ships for the CPU (a blockwise GEMM would call it once per
  128-wide K block);
* ``mxfp8 cpu op linear``: the same call for the mxfp8 recipe (1x32 groups along K on both operands, power-of-two
  scales: 32-column K blocks in the op);
* ``bf16 per-block``: the blockwise FP8 GEMM's structure on BF16 units (one BF16 GEMM per 128-wide K block, partial
  sums accumulated in FP32), whose partial sums torch rounds to BF16 -- not an FP8 GEMM's numerics, shown for its
  speed only.

``row-invariant``: whether the first 7 rows computed alone equal, bit for bit, the same rows computed in the full
batch -- what trainer = engine identity needs from a GEMM (the engine's batches differ from the trainer's).

A second table times a linear's forward + backward (y, dX and dW) as the trainer runs it: the trainer's FP8Linear
(FP32 master weight, blockwise -- and mxfp8, ``mxfp8 ...`` rows -- its weight quantized once and cached as between
optimizer updates) on the CPU op and on the emulation, against torch's native BF16 linear (BF16 input and weight, ``F.linear`` + autograd), median of
``--fwd-bwd-repeats`` (default 9). Tables, stamped: docs/results/gemm.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

DEFAULT_SHAPES = "64x512x1792,2560x512x1792,2560x1792x512,8x1024x4096,64x1024x4096"
DEFAULT_FWD_BWD = "2048x512x1792,2048x1792x512,1024x1024x3072"
BLOCK = 128


def parse_shapes(parser: argparse.ArgumentParser, text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        try:
            m, k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            parser.error(f"--shapes: {item!r} is not MxKxN (e.g. 2560x512x1792)")
        if min(m, k, n) < 8 or k % BLOCK:
            parser.error(f"--shapes: {item!r} needs M, N >= 8 and K a multiple of {BLOCK}")
        out.append((m, k, n))
    return out


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def kernels(m: int, k: int, n: int) -> dict:
    """name -> fn(rows) computing the rows ``[0, rows)`` of the batch (all rows when None)."""
    from fp8core import gemm
    from fp8core.linear import fp8_linear_forward_cpu, fp8_linear_forward_emulated, pack_weight
    from fp8core.quant import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    w_q = quantize(w, "block128", fmt="e4m3")
    w_dq = dequantize(w_q)
    x_dq = dequantize(quantize(x.float(), "group128", fmt="e4m3"))
    xb, wb = x_dq.to(torch.bfloat16), w_dq.to(torch.bfloat16)
    x8 = (x.float() / (x.float().abs().amax() / 448)).to(torch.float8_e4m3fn)
    w8 = (w / (w.abs().amax() / 448)).to(torch.float8_e4m3fn)
    ones, packed = torch.ones(n), []

    def onednn(rows):  # packed at the first call, inside measure()'s guard (a CPU without the kernel raises there)
        packed[:] = packed or [torch.ops.onednn.qlinear_prepack(w8, [m, k])]
        return torch.ops.onednn.qlinear_pointwise(x8[:rows].contiguous(), 1.0, 0, packed[0], ones, None, None, 1.0,
                                                  0, torch.float32, "none", [], "")

    def per_block(rows):
        out = torch.zeros(rows or m, n)
        for c in range(0, k, BLOCK):
            out += F.linear(xb[:rows, c:c + BLOCK], wb[:, c:c + BLOCK]).float()
        return out

    w_packed = pack_weight(w_q, "blockwise") if gemm.available() else None  # once per refit / optimizer update
    mx_packed = pack_weight(quantize(w, "group32", pow2=True), "mxfp8") if gemm.available() else None
    cpu_op = {"fp8 cpu op linear": lambda rows: fp8_linear_forward_cpu(x[:rows], w_packed, recipe="blockwise"),
              "mxfp8 cpu op linear": lambda rows: fp8_linear_forward_cpu(x[:rows], mx_packed, recipe="mxfp8",
                                                                         pow2_activation=True),
              } if w_packed is not None else {}
    return {
        **cpu_op,
        "fp8 emulated linear": lambda rows: fp8_linear_forward_emulated(x[:rows], w_dq, recipe="blockwise"),
        "fp32 gemm": lambda rows: x_dq[:rows] @ w_dq.t(),
        "bf16 linear": lambda rows: F.linear(x[:rows], wb),
        "onednn fp8": onednn,
        "bf16 per-block": per_block,
    }


def measure(shapes, repeats: int) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        found = {}
        for name, fn in kernels(m, k, n).items():
            try:
                ms = timed(lambda fn=fn: fn(None), repeats)
                invariant = torch.equal(fn(7), fn(None)[:7])
            except RuntimeError as e:  # an op this CPU's torch build lacks
                print(f"{m}x{k}x{n} {name}: not run ({str(e).splitlines()[0][:120]})")
                continue
            found[name] = (ms, invariant)
            print(f"{m}x{k}x{n} {name}: {ms:.2f} ms, row-invariant {invariant}", flush=True)
        ref = found.get("bf16 linear", (None,))[0]
        for name, (ms, invariant) in found.items():
            rows.append({"shape": f"{m}x{k}x{n}", "kernel": name, "ms": ms, "vs_bf16": ms / ref if ref else None,
                         "row_invariant": invariant})
    return rows


def fwd_bwd_kernels(m: int, k: int, n: int) -> dict:
    """name -> fn() running one forward + backward of the linear (module docstring)."""
    from fp8core import gemm
    from fp8core.linear import FP8Linear, FP8LinearConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    dy = torch.randn(m, n, generator=g)
    out = {}
    for recipe, label in (("blockwise", "fp8"), ("mxfp8", "mxfp8")):
        for backend in (["cpu"] if gemm.available() else []) + ["emulated"]:
            pow2 = recipe == "mxfp8"
            lin = FP8Linear(k, n, bias=False, config=FP8LinearConfig(recipe=recipe, backend=backend, pow2_weight=pow2,
                                                                     pow2_activation=pow2))
            with torch.no_grad():
                lin.weight.copy_(w)
            xr = x.clone().requires_grad_()

            def step(lin=lin, xr=xr):
                lin.weight.grad, xr.grad = None, None
                lin(xr).backward(dy)

            out[f"{label} {backend} fwd+bwd"] = step
    xb, wb, dyb = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_(), dy.to(torch.bfloat16)

    def bf16():
        xb.grad, wb.grad = None, None
        F.linear(xb, wb).backward(dyb)

    out["bf16 linear fwd+bwd"] = bf16
    return out


def measure_fwd_bwd(shapes, repeats: int) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        found = {name: timed(fn, repeats) for name, fn in fwd_bwd_kernels(m, k, n).items()}
        ref = found["bf16 linear fwd+bwd"]
        for name, ms in found.items():
            print(f"{m}x{k}x{n} {name}: {ms:.2f} ms ({ms / ref:.2f}x bf16)", flush=True)
            rows.append({"shape": f"{m}x{k}x{n}", "kernel": name, "ms": ms, "vs_bf16": ms / ref})
    return rows


def fwd_bwd_table(rows: list[dict]) -> str:
    lines = ["| M x K x N | linear fwd + bwd | ms | / bf16 linear |", "|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['kernel']} | {r['ms']:.2f} | {r['vs_bf16']:.2f}x |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| M x K x N | kernel | ms | / bf16 linear | row-invariant |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['vs_bf16']:.2f}x" if r["vs_bf16"] else "-"
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['ms']:.2f} | {ratio} | "
                     f"{'yes' if r['row_invariant'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated MxKxN (default {DEFAULT_SHAPES})")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per kernel and shape (median; default 7)")
    p.add_argument("--fwd-bwd-shapes", default=DEFAULT_FWD_BWD,
                   help=f"comma-separated MxKxN for the forward + backward table (default {DEFAULT_FWD_BWD}; '' skips)")
    p.add_argument("--fwd-bwd-repeats", type=int, default=9, help="timed forward + backward calls (median; default 9)")
    add_results_doc_args(p, "gemm")
    a = p.parse_args(argv)
    shapes = parse_shapes(p, a.shapes)
    fwd_bwd = parse_shapes(p, a.fwd_bwd_shapes) if a.fwd_bwd_shapes else []
    if a.repeats < 1 or a.fwd_bwd_repeats < 1:
        p.error(f"--repeats / --fwd-bwd-repeats: {a.repeats} / {a.fwd_bwd_repeats} must be >= 1")
    origin = stamp("bench.gemm", argv)
    from fp8core import gemm

    print(f"CPU FP8 GEMM: {gemm.path()}")
    body = table(measure(shapes, a.repeats))
    if fwd_bwd:
        body += "\n\n" + fwd_bwd_table(measure_fwd_bwd(fwd_bwd, a.fwd_bwd_repeats))
    print(body)
    doc = results_doc(a)
    if doc:
        details = [f"- threads: {torch.get_num_threads()}; times: median of {a.repeats} calls after one warm-up "
                   f"({a.fwd_bwd_repeats} for forward + backward)", f"- CPU FP8 GEMM: {gemm.path()}"]
        print(f"results: {shown(write_result('gemm', 'FP8 linear GEMMs on this CPU', body, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
