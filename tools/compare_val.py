"""Paired comparisons of validation results from runs' per-prompt files (run_dir/val/<set>/step_XXXXXX.jsonl, named in
run_dir/summary.json), with 95% paired-bootstrap intervals over prompts and seeds as strata (fp8core.stats).

    python -m tools.compare_val gain RUN_DIR [RUN_DIR ...]                 # end - start of each run (one per seed)
    python -m tools.compare_val diff --base B1,B2 --cand C1,C2             # candidate - base, paired by seed order
    options: --set main (the validation set), --start 0 / --end last (steps), --mean-over-steps (diff: per-prompt
             correctness averaged over the validations after step 0, the nightly regression's statistic), --json

``gain``: per run, the per-prompt correctness at ``--end`` minus at ``--start`` (same prompts), runs as strata.
``diff``: runs of the two arms in the same seed order (B1 with C1, ...), candidate minus base per prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cluster.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / torchao load
from fp8core.stats import paired_bootstrap


def _files(run_dir: str, set_name: str) -> dict[int, Path]:
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    files = (s.get("val_files") or {}).get(set_name)
    if not files:
        raise SystemExit(f"{run_dir}: summary.json has no per-prompt validation files for set {set_name!r}")
    return {int(k): Path(v) for k, v in files.items()}


def _correct(path: Path) -> dict:
    return {r["id"]: 1.0 if r["correct"] else 0.0 for r in map(json.loads, path.read_text().splitlines())}


def _step(files: dict[int, Path], which: str) -> int:
    return max(files) if which == "last" else int(which)


def _per_prompt(files: dict[int, Path], steps: list[int]) -> dict:
    rows = [_correct(files[s]) for s in steps]
    ids = set.intersection(*(set(r) for r in rows))
    return {i: sum(r[i] for r in rows) / len(rows) for i in ids}


def gain(run_dirs: list[str], *, set_name: str = "main", start: str = "0", end: str = "last", n_boot: int = 10_000):
    a, b = [], []
    for d in run_dirs:
        f = _files(d, set_name)
        s0, s1 = _step(f, start), _step(f, end)
        x, y = _correct(f[s0]), _correct(f[s1])
        ids = sorted(set(x) & set(y), key=str)
        a.append([x[i] for i in ids])
        b.append([y[i] for i in ids])
    return paired_bootstrap(a, b, n_boot=n_boot, shared_prompts=len({len(r) for r in a}) == 1)


def diff(base: list[str], cand: list[str], *, set_name: str = "main", end: str = "last", mean_over_steps: bool = False,
         n_boot: int = 10_000):
    if len(base) != len(cand):
        raise SystemExit(f"--base has {len(base)} runs, --cand {len(cand)}: pair them by seed")
    a, b = [], []
    for db, dc in zip(base, cand, strict=True):
        fb, fc = _files(db, set_name), _files(dc, set_name)
        common = sorted(set(fb) & set(fc))
        steps = [s for s in common if s > 0] if mean_over_steps else [_step({s: None for s in common}, end)]
        x, y = _per_prompt(fb, steps), _per_prompt(fc, steps)
        ids = sorted(set(x) & set(y), key=str)
        a.append([x[i] for i in ids])
        b.append([y[i] for i in ids])
    return paired_bootstrap(a, b, n_boot=n_boot, shared_prompts=len({len(r) for r in a}) == 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.compare_val", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gain")
    g.add_argument("runs", nargs="+")
    g.add_argument("--start", default="0")
    d = sub.add_parser("diff")
    d.add_argument("--base", required=True)
    d.add_argument("--cand", required=True)
    d.add_argument("--mean-over-steps", action="store_true")
    for p in (g, d):
        p.add_argument("--set", default="main")
        p.add_argument("--end", default="last")
        p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "gain":
        e = gain(args.runs, set_name=args.set, start=args.start, end=args.end)
        what = f"gain ({args.end} - {args.start}) on {args.set}, {len(args.runs)} run(s)"
    else:
        e = diff(args.base.split(","), args.cand.split(","), set_name=args.set, end=args.end,
                 mean_over_steps=args.mean_over_steps)
        what = f"cand - base on {args.set}" + (" (mean over validations after step 0)" if args.mean_over_steps else
                                               f" at step {args.end}")
    if args.json:
        print(json.dumps({"what": what, **e.as_dict()}))
    else:
        print(f"{what}: {e.value:+.4f} [95% CI {e.lo:+.4f}, {e.hi:+.4f}] over {e.n} prompt-runs; "
              f"seed SD {e.seed_sd:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
