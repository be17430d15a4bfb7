"""Asynchronous GRPO against synchronous, side by side: the real flow (``python -m flows.grpo``) on the bench
workload, each mode with the same seed and steps, in two CPU layouts.

    .venv/bin/python -m bench.async_grpo                   # 8 steps per run, 4 runs; docs/results/async.md
    .venv/bin/python -m bench.async_grpo --steps 4 --layouts pinned --no-results-doc

Layouts: ``pinned`` -- one thread per worker, the trainer and the engine each pinned to its own core
(``policy.threads=1 policy.generation.vllm_cfg.threads=1 cluster.pin_cpus=true``: the layout of a cluster, where the
engine and the trainer own their hardware); ``shared`` -- the CPU default (two threads per worker, both workers on
all cores). Per run: the step interval (summary.json ``step_interval_s``: wall time between consecutive step
completions, steps 2..N, the same definition in both modes), ``mean_step_s``, and, asynchronous, the share of the
train task with a rollout in flight (``async/train_overlap_frac``; at most rollout time / train time) and the share
of the rollout time that ran while the step trained (``async/rollout_hidden_frac``), medians over the steps that
generate ahead. The ratio async / sync per layout. A bench run's validation and checkpoints are off (bench.flow_run)."""
from __future__ import annotations

import argparse
import json
import sys

from bench.flow_run import run_flow
from bench.workload import ROOT, default_workload
from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

RECIPE = "configs/tiny_fp8_e2e.yaml"
LAYOUTS = {"pinned": ("policy.threads=1", "policy.generation.vllm_cfg.threads=1", "cluster.pin_cpus=true"),
           "shared": ()}
MODES = {"sync": ("grpo.async_grpo.enabled=false",), "async": ("grpo.async_grpo.enabled=true",)}


def table(rows: list[dict]) -> str:
    lines = ["| layout | mode | step interval (s) | mean step (s) | train with a rollout in flight | rollout hidden "
             "behind training | async / sync |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sync = next(x for x in rows if x["layout"] == r["layout"] and x["mode"] == "sync")
        ratio = f"{r['step_interval_s'] / sync['step_interval_s']:.2f}x" if r["mode"] == "async" else "-"
        overlap = f"{r['train_overlap_frac']:.0%}" if r["mode"] == "async" else "-"
        hidden = f"{r['rollout_hidden_frac']:.0%}" if r["mode"] == "async" else "-"
        lines.append(f"| {r['layout']} | {r['mode']} | {r['step_interval_s']:.2f} | {r['mean_step_s']:.2f} | "
                     f"{overlap} | {hidden} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.async_grpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (default 8; the interval uses 2..N)")
    p.add_argument("--layouts", default="pinned,shared", help="comma-separated of: " + ", ".join(LAYOUTS))
    p.add_argument("--quick-model", action="store_true", help="the tests' quick SFT model (seconds to build)")
    add_results_doc_args(p, "async")
    a = p.parse_args(argv)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        p.error(f"--layouts: {', '.join(bad) or '(empty)'} not among {', '.join(LAYOUTS)}")
    if a.steps < 3:
        p.error(f"--steps: {a.steps} must be >= 3 (the interval needs steps 2..N)")
    origin = stamp("bench.async_grpo", argv)
    w = default_workload(quick=a.quick_model)
    rows = []
    for layout in layouts:
        for mode, keys in MODES.items():
            r = run_flow(RECIPE, w, steps=a.steps, overrides=(*LAYOUTS[layout], *keys), label=f"{layout}-{mode}")
            rows.append({"layout": layout, "mode": mode, **r})
            print(f"{layout} {mode}: step interval {r['step_interval_s']:.2f}s, mean step {r['mean_step_s']:.2f}s, "
                  f"train with a rollout in flight {r['train_overlap_frac']:.0%}, rollout hidden "
                  f"{r['rollout_hidden_frac']:.0%}", flush=True)
    body = table(rows)
    print(body)
    out = ROOT / "runs" / "bench" / "async.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    doc = results_doc(a)
    if doc:
        details = [f"- recipe: `{RECIPE}` on the bench workload (16 prompts x 8 samples, 32 new tokens, 2 updates); "
                   f"{a.steps} steps per run, validation and checkpoints off"]
        print(f"results: {shown(write_result('async', 'Asynchronous GRPO: step interval', body, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
