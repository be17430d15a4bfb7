"""The performance bench: one command, one table, measured side by side in one run:

    bash scripts/bench.sh                       # = .venv/bin/python -m bench --trl-python .venv-bench/bin/python
    .venv/bin/python -m bench --skip-trl --skip-steps --no-results-doc   # numerics only (~1 min)

Rows (ratios; lower is better unless said otherwise):
* P1: the project's GRPO step / TRL GRPOTrainer's step on the same model, prompts, reward and batch, for the BF16
  reference recipe (configs/tiny_bf16.yaml) and end-to-end FP8 (configs/tiny_fp8_e2e.yaml). Target <= 1.0, aim 0.5.
* P3: FP8 step / BF16 step (target <= 1.15); beside it the FP8 step over the BF16 reference with a native BF16 trainer
  (``policy.precision=bfloat16``: torch's BF16 GEMMs on the CPU's BF16 units), the fastest BF16 the CPU has.
* quantize throughput / copy throughput (target >= 25%); FP8 linear fwd+bwd / torch's native BF16 linear (BF16
  input and weight; target <= 1.5 on AVX-512 BF16, <= 2.0 on AMX) at the tiny model's shapes and at 1024 -> 4096;
  BF16 linear (autocast, emulated) / FP32.
* with ``--mxfp8``: the end-to-end MXFP8 recipe's step (configs/tiny_mxfp8_e2e.yaml) over blockwise FP8's.
* refit share of the step; the step's profile (old-logprob pass, train forward/backward, optimizer, rollout,
  reward, refit), medians of steps 2..N.
Project steps are timed in-process (bench/step.py: no Prefect/Ray/MLflow). The orchestration rows come from a short
run of the real flow on the same workload (bench/flow_run.py, ``--flow-steps``): the orchestration share and the
refit + KV-calibration share of its steps, and the time to the first step. Results are logged to the MLflow
experiment ``bench`` and written to runs/bench/latest.json; the table, stamped (commit, date, CPU, command line:
tools.results), to docs/results/bench.md (``--results-doc PATH``; ``--no-results-doc`` for none: a partial run such
as ``--skip-steps`` would replace the published table).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import process.quiet  # noqa: F401  third-party start-up noise off before transformers / torchao load
from bench.workload import ROOT
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

RECIPES = {"bf16": "configs/tiny_bf16.yaml", "fp8": "configs/tiny_fp8_e2e.yaml", "mxfp8": "configs/tiny_mxfp8_e2e.yaml"}
# the project's step sides: (recipe, overrides); bf16_native = the BF16 reference with a native BF16 trainer (torch's
# BF16 GEMMs on the CPU's BF16 units): FP8 against the fastest BF16 the CPU has
SIDES = {"bf16": (RECIPES["bf16"], ()), "fp8": (RECIPES["fp8"], ()),
         "bf16_native": (RECIPES["bf16"], ("policy.precision=bfloat16",))}
TINY_SHAPES = [(2560, 256, 512), (2560, 512, 256), (2560, 256, 128)]  # tokens x in -> out of the tiny model's linears
BIG_SHAPES = [(512, 1024, 4096)]


def _interleaved(fns: dict, reps: int) -> dict[str, float]:
    """min seconds per call of each fn, called round-robin (same machine state for all) after one warm-up each."""
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def bench_quantize(shape=(2048, 4096), reps: int = 7) -> dict[str, float]:
    """Input bytes / s of quantize per granularity and of a same-size copy (BF16 input)."""
    from fp8core.quant import GRANULARITIES, quantize

    x = torch.randn(shape, dtype=torch.bfloat16)
    fns = {"copy": lambda: x.clone(), **{g: (lambda g=g: quantize(x, g)) for g in GRANULARITIES}}
    t = _interleaved(fns, reps)
    nbytes = x.numel() * x.element_size()
    return {k: nbytes / v / 1e9 for k, v in t.items()}


def bench_linear(shapes, reps: int = 5) -> list[dict]:
    """fwd+bwd seconds of y = x @ W.T (dX and dW) per implementation, relative to FP32; FP8 through FP8Linear
    (its weight cache as in training: the weight does not change between repetitions, like micro-batches)."""
    from torch import nn

    from fp8core.bf16 import BF16Emulation
    from fp8core.linear import FP8Linear, FP8LinearConfig

    out = []
    for t, k, n in shapes:
        g = torch.Generator().manual_seed(0)
        lin = nn.Linear(k, n, bias=False)
        x, dy = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
        emu = BF16Emulation()

        def run(mod, ctx=None, x=x, dy=dy):
            def f():
                xx = x.detach().requires_grad_()
                if ctx is None:
                    y = mod(xx)
                else:
                    with ctx():
                        y = mod(xx)
                y.backward(dy.to(y.dtype))
            return f

        native = nn.Linear(k, n, bias=False).to(torch.bfloat16)  # torch's BF16 linear on the CPU's BF16 units
        fns = {"fp32": run(lin), "bf16_autocast": run(lin, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
               "bf16_emulated": run(lin, lambda emu=emu: emu),
               "bf16_native": run(native, x=x.to(torch.bfloat16), dy=dy.to(torch.bfloat16))}
        for r in ("blockwise", "rowwise", "tensorwise"):
            fns[f"fp8_{r}"] = run(FP8Linear.from_linear(lin, FP8LinearConfig(recipe=r)))
        s = _interleaved(fns, reps)
        out.append({"shape": f"{t}x{k}->{n}", "fp32_ms": s["fp32"] * 1e3, "bf16_native_ms": s["bf16_native"] * 1e3,
                    **{f"{k_}/fp32": v / s["fp32"] for k_, v in s.items() if k_ != "fp32"},
                    **{f"fp8_{r}/bf16": s[f"fp8_{r}"] / s["bf16_native"] for r in ("blockwise", "rowwise", "tensorwise")}})
    return out


def cpu_line() -> dict:
    try:
        from fp8core.cpu import cpu_caps

        c = cpu_caps()
        return {"model": c.model, "kind": c.kind, "flags": ",".join(sorted(c.flags)), "native_bf16": c.native_bf16,
                "torch_capability": c.torch_capability}
    except Exception as e:  # noqa: BLE001 - the bench still runs without fp8core.cpu
        return {"model": platform.processor() or "unknown", "error": repr(e)}


def run_trl(python: str, workload, steps: int) -> dict | None:
    if not Path(python).exists():
        print(f"bench: no TRL venv at {python} (scripts/bench.sh creates it): TRL rows skipped", file=sys.stderr)
        return None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([python, "-m", "bench.trl_step", workload.to_json(), "--steps", str(steps)], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if proc.returncode != 0 or line is None:
        print(f"bench: TRL step failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("BENCH_JSON "):])


def _fmt(v, spec=".2f"):
    return "n/a" if v is None else format(v, spec)


def table(res: dict) -> str:
    rows = ["| metric | value | target |", "|---|---|---|"]
    la, lb = res.get("load_average_start"), res.get("load_average_end")
    if la is not None and lb is not None:
        rows.append(f"| 1-min load average at start / end (other work on the machine skews the ratios) | "
                    f"{la:.1f} / {lb:.1f} | quiet: below the core count |")
    steps, trl = res.get("steps", {}), res.get("trl")
    bf, f8, bn = (steps.get(k, {}).get("median", {}).get("step_s") for k in ("bf16", "fp8", "bf16_native"))
    t = trl["median_step_s"] if trl else None
    if t:
        rows.append(f"| TRL GRPOTrainer step (s, median of steps 2..) | {t:.2f} | |")
    mx = steps.get("mxfp8", {}).get("median", {}).get("step_s")
    for name, s in (("bf16", bf), ("fp8", f8), ("bf16_native", bn), ("mxfp8", mx)):
        if s is not None:
            mode = steps[name].get("bf16_mode")
            what = "BF16 reference, native BF16 trainer" if name == "bf16_native" else f"trainer bf16_mode {mode}"
            rows.append(f"| project step {name} (s; {what}) | {s:.2f} | |")
            rows.append(f"| P1 {name}: project step / TRL step | {_fmt(s / t if t else None)} | <= 1.0 (aim 0.5) |")
    if bf and f8:
        rows.append(f"| P3: FP8 step / BF16 step | {f8 / bf:.2f} | <= 1.15 |")
    if bn and f8:
        rows.append(f"| FP8 step / BF16 step with a native BF16 trainer | {f8 / bn:.2f} | |")
    if mx and f8:
        rows.append(f"| MXFP8 step (1x32 groups, E8M0 scales) / FP8 blockwise step | {mx / f8:.2f} | |")
    for name in ("bf16", "fp8"):
        med = steps.get(name, {}).get("median")
        if med:
            rows.append(f"| refit share of the {name} step | {med['refit_s'] / med['step_s']:.1%} | <= 3% |")
            prof = ", ".join(f"{k[:-2]} {med[k]:.2f}" for k in ("rollout_s", "old_logprob_s", "train_fwd_bwd_s",
                                                                  "optimizer_s", "reward_s", "refit_s"))
            rows.append(f"| {name} step profile (s) | {prof} | |")
    fl = res.get("flow")
    if fl:
        rows.append(f"| orchestration share of the FP8 flow step (Prefect/Ray/MLflow; step {fl['step_s']:.2f} s, "
                    f"median of steps 2..{fl['steps']}) | {fl['share_orchestration']:.1%} | <= 5% |")
        rows.append(f"| refit + KV calibration share of the FP8 flow step | {fl['share_refit_kv']:.1%} | <= 3% |")
        rows.append(f"| time to first step (process start -> step 1 begins; workers up {fl['workers_up_s']:.1f} s) | "
                    f"{fl['time_to_first_step_s']:.1f} s | |")
    elif steps:
        rows.append("| orchestration share (Prefect/Ray/MLflow) | not measured (--flow-steps 0) | <= 5% |")
    q = res.get("quantize")
    if q:
        for g in ("tensorwise", "rowwise", "group128", "block128"):
            rows.append(f"| quantize {g}: GB/s / copy GB/s ({q[g]:.2f} / {q['copy']:.2f}) | {q[g] / q['copy']:.0%} "
                        f"| >= 25% |")
    for lin in res.get("linear", []):
        worst = max(lin[f"fp8_{r}/bf16"] for r in ("blockwise", "rowwise", "tensorwise"))
        rows.append(f"| linear fwd+bwd {lin['shape']}: FP8 (worst recipe) / native BF16 linear (BF16 "
                    f"{lin['bf16_native_ms']:.1f} ms, FP32 {lin['fp32_ms']:.1f} ms) | {worst:.2f} | <= 1.5 (AVX-512 BF16), "
                    f"<= 2.0 (AMX) |")
        rows.append(f"| linear fwd+bwd {lin['shape']}: BF16 autocast / FP32, BF16 emulated / FP32 | "
                    f"{lin['bf16_autocast/fp32']:.2f}, {lin['bf16_emulated/fp32']:.2f} | emulated ~1 |")
    return "\n".join(rows)


def log_mlflow(res: dict, uri: str) -> str | None:
    try:
        import mlflow
    except ImportError:
        return None
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("bench")
    flat = {f"quantize/{g}_gbps": x for g, x in (res.get("quantize") or {}).items()}
    for lin in res.get("linear", []):
        flat.update({f"linear/{lin['shape']}/{k}": v for k, v in lin.items() if k != "shape"})
    for name, s in res.get("steps", {}).items():
        flat.update({f"step/{name}/{k}": v for k, v in s["median"].items()})
    if res.get("trl"):
        flat["step/trl/step_s"] = res["trl"]["median_step_s"]
    for k, v in (res.get("flow") or {}).items():
        if isinstance(v, (int, float)):
            flat[f"flow/{k}"] = v
    for k, v in res.get("ratios", {}).items():
        flat[f"ratio/{k}"] = v
    with mlflow.start_run(run_name=f"bench-{time.strftime('%Y%m%d-%H%M%S')}") as run:
        mlflow.log_params({f"cpu/{k}": str(v)[:500] for k, v in res["cpu"].items()})
        mlflow.log_params({"torch": torch.__version__, "threads_numerics": 1,
                           "qdq_kernel": str(res.get("qdq_kernel", "n/a"))[:500]})
        mlflow.log_metrics({k.replace(">", "to"): float(v) for k, v in flat.items() if isinstance(v, (int, float))})
        mlflow.log_text(res["table"], "bench_table.md")
        return run.info.run_id


NOTE = ("What each row measures: [performance](../performance.md#the-bench-one-command-one-table). `bash "
        "scripts/bench.sh` runs this command with the TRL peer (`--trl-python .venv-bench/bin/python`).")


def write_results_doc(res: dict, origin: dict, path: str | Path | None = None) -> Path:
    """The stamped results file of a bench run (``res``: latest.json's content, with its table; ``origin``:
    tools.results.stamp taken when the command started)."""
    details = [f"- torch {res['torch']}; quantize: {res.get('qdq_kernel', 'n/a')}"]
    w = res.get("workload")
    if w:
        details.append(f"- workload: model `{shown(w['model_dir'])}`, {w['num_prompts']} prompts x "
                       f"{w['num_generations']} samples x <= {w['max_new_tokens']} tokens; {res.get('steps_per_side')} "
                       "steps per side")
    if res.get("mlflow_run_id"):
        details.append(f"- MLflow run `{res['mlflow_run_id']}` in experiment `bench`; JSON: runs/bench/latest.json")
    return write_result("bench", "Bench: results", res["table"], origin, note=NOTE, details=details, path=path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="RL steps per side (medians use steps 2..N)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--skip-steps", action="store_true", help="numerics only")
    p.add_argument("--mxfp8", action="store_true",
                   help="also time the end-to-end MXFP8 recipe's step (configs/tiny_mxfp8_e2e.yaml) beside blockwise's")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI",
                                                             f"sqlite:///{ROOT / 'runs' / 'bench' / 'mlflow.db'}"))
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--flow-steps", type=int, default=4,
                   help="steps of the real flow (Prefect + Ray + MLflow) for the orchestration rows; 0 = skip")
    p.add_argument("--quick-model", action="store_true",
                   help="the tests' 12-step SFT model instead of runs/assets' 300-step one (no 300-step SFT build)")
    add_results_doc_args(p, "bench")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    from fp8core.cpu import apply_cpu_cap

    apply_cpu_cap()  # FP8GRPO_CPU_CAP=avx2 measures this machine as an AVX2-only one (before any op / vLLM import)
    origin = stamp("bench", argv)  # the code that runs, before the measurement (after the cap: the kind it runs as)
    (ROOT / "runs" / "bench").mkdir(parents=True, exist_ok=True)
    res: dict = {"cpu": cpu_line(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    from fp8core import kernels

    res["qdq_kernel"] = kernels.describe()
    res["load_average_start"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"# bench: {res['cpu']}; torch {torch.__version__}; quantize: {res['qdq_kernel']}; load average "
          f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.1f}", flush=True)
    from process.memory import keep_freed_heap_memory

    keep_freed_heap_memory()  # the trainer's allocator setting (PolicyWorker sets it too)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # numerics: one thread, stable on a shared machine
    res["quantize"] = bench_quantize()
    res["linear"] = bench_linear(TINY_SHAPES + BIG_SHAPES)
    torch.set_num_threads(threads)
    if not args.skip_steps:
        from bench.step import run_project
        from bench.workload import default_workload

        w = default_workload(quick=args.quick_model)
        res["workload"] = json.loads(w.to_json())
        res["steps_per_side"] = args.steps
        if not args.skip_trl:
            res["trl"] = run_trl(args.trl_python, w, args.steps)
        sides = {**SIDES, **({"mxfp8": (RECIPES["mxfp8"], ())} if args.mxfp8 else {})}
        res["steps"] = {name: run_project(recipe, w, steps=args.steps, overrides=extra)
                        for name, (recipe, extra) in sides.items()}
        if args.flow_steps:
            from bench.flow_run import run_flow

            res["flow"] = run_flow(RECIPES["fp8"], w, steps=args.flow_steps)
    ratios = {}
    t = (res.get("trl") or {}).get("median_step_s")
    meds = {k: v["median"]["step_s"] for k, v in res.get("steps", {}).items()}
    for k, v in meds.items():
        if t:
            ratios[f"p1_{k}"] = v / t
    if "fp8" in meds and "bf16" in meds:
        ratios["p3_fp8_over_bf16"] = meds["fp8"] / meds["bf16"]
    if "fp8" in meds and "bf16_native" in meds:
        ratios["fp8_over_bf16_native"] = meds["fp8"] / meds["bf16_native"]
    if "fp8" in meds and "mxfp8" in meds:
        ratios["mxfp8_over_fp8"] = meds["mxfp8"] / meds["fp8"]
    res["ratios"] = ratios
    res["load_average_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    res["table"] = table(res)
    print(res["table"])
    (ROOT / "runs" / "bench" / "latest.json").write_text(json.dumps(res, indent=1, default=str))
    if not args.no_mlflow:
        run_id = log_mlflow(res, args.tracking_uri)
        res["mlflow_run_id"] = run_id
        print(f"MLflow experiment 'bench' run {run_id} at {args.tracking_uri}")
    doc = results_doc(args)
    if doc is not None:
        print(f"bench: results written to {write_results_doc(res, origin, doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
