"""Refit transports side by side: the pipeline's refit task (tasks.rl.refit) over the refit group and over Ray's
object store, with N engines and M data-parallel trainers, at the bench's model sizes, in one run.

    .venv/bin/python -m bench.refit [--sizes small,medium,large] [--engines 2] [--trainers 2] [--repeats 3]
                                    [--recipe configs/tiny_fp8_e2e.yaml] [--results-doc PATH | --no-results-doc]

Per size, transport and engine loader (``policy.generation.vllm_cfg.refit_loader``: the in-place copy on both
transports, and vLLM's reload over the group, the loader before it) the workers are started fresh
(cluster.start_workers, ``cluster.refit_transport`` set), every worker's peak RSS is reset, one refit warms up (and forms the group), then ``--repeats`` refits run through the refit
task. Reported: the median refit seconds and its parts (the senders making their buckets, the wire, the engines'
loader); the served state S (the FP8 codes, scales and BF16 rest: what the group's senders broadcast, less alignment
and checksums); the bytes that cross between processes per refit (the group: each sender's share to each engine,
N x S; the object store: rank 0's gather of the FP32 shards, 4 B x P x (M - 1) / M, then S
to each of the N engines); and the largest peak RSS above the RSS before the first refit, of the trainer ranks and
of the engines -- what refits add to a process, including what it keeps mapped after freeing it. ``bench.layouts``
extrapolates bytes and memory (not seconds) to the GPU recipes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from tools.results import add_results_doc_args, results_doc, shown, stamp, write_result

ROOT = Path(__file__).resolve().parents[1]
# (transport, engine loader) per row: both transports with the default loader, and the group with vLLM's reload
ARMS = (("collective", "in_place"), ("object_store", "in_place"), ("collective", "vllm_reload"))


def measure(model_dir: Path, recipe: str, size: str, transport: str, engines: int, trainers: int, repeats: int,
            out: Path, threads: int = 1, loader: str = "in_place") -> dict:
    """One row: fresh workers of ``recipe`` on ``model_dir``, ``repeats`` refits through the refit task."""
    from cluster.runtime import actor, get, policy_refs, start_workers, stop_workers
    from configs.schema import load_config
    from tasks import rl
    from tasks.context import RunContext
    from trainer.policy import PolicyWorker

    over = [f"cluster.rollout_workers={engines}", f"cluster.policy_workers={trainers}",
            f"cluster.refit_transport={transport}", f"policy.generation.vllm_cfg.refit_loader={loader}",
            "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216",
            "ray.rollout_worker.num_cpus=0.5", "ray.policy_worker.num_cpus=0.5", f"run_dir={out / 'run'}",
            # one thread per worker: N + M workers on a machine of few cores would otherwise spin at each other's
            # OpenMP barriers, and the bench would measure that
            f"policy.threads={threads}", f"policy.generation.vllm_cfg.threads={threads}"]
    cfg = load_config(ROOT / recipe, over)
    workers = start_workers(cfg, model_dir, out / "run", f"refit-{size}-{transport}")
    try:
        ctx = RunContext.from_config(cfg, policy=workers.policy_name, policy_ranks=workers.policy_names,
                                     rollouts=workers.rollout_names, run_id=None, tracking_uri=None,
                                     model_dir=str(model_dir), checkpoint_uri=None)
        ctx = replace(ctx, refit_transport=transport)
        params = get(actor(ctx.policy).info.remote())["num_params"]
        # peaks from before the first refit: what the refits add to each process, including what a process keeps
        # mapped after a refit freed it (the trainer keeps its freed heap; a later peak would not show it again)
        before_t = get(policy_refs(ctx.trainers, PolicyWorker.memory, reset=True))
        before_e = get([actor(n).memory.remote(reset=True) for n in ctx.rollouts])
        rl.refit.fn(ctx)  # warm-up (and the group's formation)
        seconds, sent, parts = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = rl.refit.fn(ctx)
            seconds.append(time.perf_counter() - t0)
            sent.append(m.get("refit/bytes_sent"))
            # the engines' loader: its own clock over the group; the engine's refit call over the object store
            parts.append({"load": m["time/refit_engine_s"],
                          **{k: m[f"time/refit_{k}_s"] for k in ("make", "wire", "load") if f"time/refit_{k}_s" in m}})
        after_t = get(policy_refs(ctx.trainers, PolicyWorker.memory))
        after_e = get([actor(n).memory.remote() for n in ctx.rollouts])
        trainer_peak = max(a["peak"] - b["rss"] for a, b in zip(after_t, before_t, strict=True))
        engine_peak = max(a["peak"] - b["rss"] for a, b in zip(after_e, before_e, strict=True))
        served = _served_bytes(ctx)
        loaders = {get(actor(n).stats.remote())["refit_loader"] for n in ctx.rollouts}
    finally:
        stop_workers(workers)
    moved = (engines * served if transport == "collective"
             else 4 * params * (trainers - 1) / trainers + engines * served)
    return {"size": size, "params": params, "transport": transport, "loader": "/".join(sorted(loaders)),
            "engines": engines, "trainers": trainers,
            "seconds": statistics.median(seconds), "all_seconds": seconds, "served_bytes": served,
            "sent_bytes": sent[-1], "moved_bytes": moved, "trainer_peak_add": trainer_peak,
            "engine_peak_add": engine_peak,
            "parts_s": {k: statistics.median(p[k] for p in parts) for k in parts[0]} if parts and parts[0] else {}}


def _served_bytes(ctx) -> int:
    """The served state's bytes (rank 0's ``refit_weights``; every rank takes part in its gather)."""
    import ray

    from cluster.runtime import get, policy_refs
    from trainer.policy import PolicyWorker

    refs = policy_refs(ctx.trainers, PolicyWorker.refit_weights)
    get(refs)
    return sum(t.numel() * t.element_size() for t in ray.get(refs[0]).values())


def table(rows: list[dict]) -> str:
    out = ["| size | params | transport | engine loader | engines x trainers | refit s (median) | engines' load s | "
           "speed vs object store | served S MB | moved per refit MB | trainer peak added MB | engine peak added MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["size"]: r for r in rows if r["transport"] == "object_store" and r["loader"] == "in_place"}
    for r in rows:
        b = base.get(r["size"])
        speed = f"{b['seconds'] / r['seconds']:.2f}x" if b and r is not b else ""
        load = r.get("parts_s", {}).get("load")
        out.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['transport']} | {r['loader']} | "
                   f"{r['engines']} x {r['trainers']} | {r['seconds']:.3f} | {'' if load is None else f'{load:.3f}'} | "
                   f"{speed} | {r['served_bytes'] / 2**20:.1f} | {r['moved_bytes'] / 2**20:.1f} | "
                   f"{r['trainer_peak_add'] / 2**20:.1f} | {r['engine_peak_add'] / 2**20:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from bench.memory import SIZES, build_model

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,medium,large", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per worker")
    p.add_argument("--recipe", default="configs/tiny_fp8_e2e.yaml")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-refit")
    add_results_doc_args(p, "refit-transports")
    a = p.parse_args(argv)
    sizes = [s for s in a.sizes.split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes):
        p.error(f"--sizes: unknown {a.sizes!r}; known: {', '.join(SIZES)}")
    if a.engines < 1 or a.trainers < 1 or a.repeats < 1:
        p.error("--engines, --trainers and --repeats must be >= 1")
    origin = stamp("bench.refit", argv)
    import ray

    from cluster.runtime import init_ray
    from configs.schema import load_config

    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    models = {s: build_model(s, a.out) for s in sizes}
    started = init_ray(load_config(ROOT / a.recipe, ["ray.num_cpus=4"]), a.out / "ray")
    rows = []
    try:
        for s in sizes:
            for t, loader in ARMS:
                r = measure(models[s], a.recipe, s, t, a.engines, a.trainers, a.repeats, a.out, a.threads, loader)
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if started:
            ray.shutdown()
    body = table(rows)
    print(body)
    doc = results_doc(a)
    if doc:
        details = [f"- recipe `{a.recipe}` (end-to-end FP8, blockwise), {a.engines} engines and {a.trainers} "
                   f"data-parallel trainers on one machine (gloo over loopback), {a.threads} thread(s) per worker, median of "
                   f"{a.repeats} refits after a warm-up; peaks are RSS above the RSS before the first refit "
                   "(process.memory, VmHWM reset)"]
        print(f"results: {shown(write_result('refit-transports', 'Refit transports side by side', body, origin, details=details, path=doc))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
