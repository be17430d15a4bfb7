"""Paired comparisons of validation results from runs' per-prompt files (run_dir/val/<set>/step_XXXXXX.jsonl, named in
run_dir/summary.json), with 95% paired-bootstrap intervals over prompts and seeds as strata (fp8core.stats).

    python -m tools.compare_val gain RUN_DIR [RUN_DIR ...]                 # end - start of each run (one per seed)
    python -m tools.compare_val diff --base B1,B2 --cand C1,C2             # candidate - base, paired by seed order
    options: --set main (the validation set), --start 0 / --end last (steps), --mean-over-steps (diff: per-prompt
             correctness averaged over the validations after step 0, the nightly regression's statistic), --json

``gain``: per run, the per-prompt correctness at ``--end`` minus at ``--start`` (same prompts), runs as strata.
``diff``: runs of the two arms in the same seed order (B1 with C1, ...), candidate minus base per prompt.

The bootstrap interval resamples prompts within the given runs, so it answers "on these seeds"; with two runs or more
the line also gives a Student-t interval over the runs' per-seed differences, which answers "over training seeds" and
is the one to read when the seed SD is larger than the prompt noise (a few seeds give a wide one).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / torchao load
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


def over_seeds(e, n_runs: int) -> tuple[float, float]:
    """Student-t interval of the mean over ``n_runs`` per-seed values from ``e``'s mean and seed SD (nan with one)."""
    if n_runs < 2 or math.isnan(e.seed_sd):
        return float("nan"), float("nan")
    from scipy.stats import t

    half = float(t.ppf(0.5 + e.confidence / 2, n_runs - 1)) * e.seed_sd / math.sqrt(n_runs)
    return e.value - half, e.value + half


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
    n_runs = len(args.runs) if args.cmd == "gain" else len(args.base.split(","))
    if args.cmd == "gain":
        e = gain(args.runs, set_name=args.set, start=args.start, end=args.end)
        what = f"gain ({args.end} - {args.start}) on {args.set}, {len(args.runs)} run(s)"
    else:
        e = diff(args.base.split(","), args.cand.split(","), set_name=args.set, end=args.end,
                 mean_over_steps=args.mean_over_steps)
        what = f"cand - base on {args.set}" + (" (mean over validations after step 0)" if args.mean_over_steps else
                                               f" at step {args.end}")
    lo, hi = over_seeds(e, n_runs)
    if args.json:
        print(json.dumps({"what": what, **e.as_dict(), "seeds": n_runs, "seeds_lo": lo, "seeds_hi": hi}))
    else:
        seeds = f"; over the {n_runs} seeds [t 95% CI {lo:+.4f}, {hi:+.4f}]" if n_runs > 1 else ""
        print(f"{what}: {e.value:+.4f} [95% CI {e.lo:+.4f}, {e.hi:+.4f}] over {e.n} prompt-runs; "
              f"seed SD {e.seed_sd:.4f}{seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
