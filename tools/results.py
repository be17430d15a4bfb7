"""Results files under docs/results/: the command that measures a table writes it there, stamped with where it came
from, and the next run of that command overwrites it.

    origin = stamp("experiments.recipe_table", argv)   # when the command starts: the code that runs
    ...                                                # the measurement (minutes to hours)
    write_result("recipe_table", "Recipe table: results", body, origin, note="What the arms are: ...")

A file reads::

    # <title>

    Written by `.venv/bin/python -m <module>`; the next run of that command overwrites this file.

    <note>

    - commit: `<short hash>[+dirty]` (uncommitted changes in <files>)
    - date: <YYYY-MM-DD HH:MM> UTC
    - CPU: <model> (kind `<fp8core.cpu kind>`)
    - command: `.venv/bin/python -m <module> <args>`
    <details: more "- ..." lines of the command's own>

    <body>

Commands take ``--results-doc PATH`` (``add_results_doc_args``; default docs/results/<name>.md) and
``--no-results-doc`` / ``--results-doc ''`` to write none (tests, quick runs). ``$FP8GRPO_RESULTS_DIR`` moves the
default folder (the test suite points it under runs/test-env, so no test rewrites the published files). PNG figures
passed as ``images`` are copied next to the file's folder, into ``<folder>/../img/``, where the body's
``../img/<name>.png`` references find them.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR_ENV = "FP8GRPO_RESULTS_DIR"
# What the commands write, not what they run: changes here do not make a stamp's tree dirty (a command run after
# another one has rewritten its results file measures the committed code all the same)
OUTPUTS = ("docs/results/", "docs/img/")


def results_dir() -> Path:
    """The folder result files go to by default: ``$FP8GRPO_RESULTS_DIR``, else docs/results."""
    return Path(os.environ.get(RESULTS_DIR_ENV) or ROOT / "docs" / "results")


def shown(path: str | Path) -> str:
    """``path`` as a results file names it: relative to the project when inside it (no machine's absolute path)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def stamp(module: str, argv: Sequence[str], *, repo: Path = ROOT) -> dict:
    """Where a table comes from, taken when the command starts (before the measurement, so later edits to the tree
    do not leak in): the commit of ``repo`` (``+dirty`` and the changed tracked files when the tree differs from it
    outside :data:`OUTPUTS`, the results files and figures the commands write),
    the UTC date, this process's CPU model and kind (fp8core.cpu.cpu_caps: after FP8GRPO_CPU_CAP, so call it after
    ``apply_cpu_cap``), and the command line ``<python> -m <module> <argv>`` (the project's .venv/bin/python as
    such, not its resolved target)."""
    exe = _exe()
    return {**_origin(repo), "writer": shlex.join([exe, "-m", module]), "command": shlex.join([exe, "-m", module, *argv])}


def invocation(*, repo: Path = ROOT) -> dict:
    """:func:`stamp` of this process as it was started (``sys.orig_argv``: ``.venv/bin/python -m experiments.x
    ...`` or the ``fp8-grpo`` script's line), for code that does not know its command's module: a grid records it
    with every run it trains, so a results file written by a resumed grid names each invocation behind its runs."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return {**_origin(repo), "command": shlex.join([_exe(), *argv[1:]])}


def _exe() -> str:
    exe = Path(sys.executable)
    return str(exe.relative_to(ROOT) if exe.is_relative_to(ROOT) else exe)


def _origin(repo: Path) -> dict:
    from fp8core.cpu import cpu_caps

    try:
        commit = _git("rev-parse", "--short", "HEAD", cwd=repo).strip()
        changed = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no", cwd=repo).splitlines()
                   if not line[3:].startswith(OUTPUTS)]
    except (OSError, subprocess.CalledProcessError):
        commit, changed = "unknown", []
    caps = cpu_caps()
    return {"commit": commit + ("+dirty" if changed else ""), "dirty_files": changed,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu_kind": caps.kind, "cpu_model": caps.model}


def commit_text(stamp: dict) -> str:
    """The backquoted hash (``+dirty`` for a dirty tree) and, for a dirty tree, `` (uncommitted changes in <files>)``:
    the code a stamp (or a grid run's origin) ran."""
    dirty = stamp.get("dirty_files") or []
    return f"`{stamp['commit']}`" + (f" (uncommitted changes in {', '.join(dirty)})" if dirty else "")


def format_result(title: str, body_markdown: str, stamp: dict, *, note: str = "",
                  details: Sequence[str] = ()) -> str:
    """The whole file (module docstring's layout); ``details``: further ``- ...`` lines after the stamp's."""
    lines = [f"# {title}", "",
             f"Written by `{stamp['writer']}`; the next run of that command overwrites this file.", "",
             *([note, ""] if note else []),
             f"- commit: {commit_text(stamp)}", f"- date: {stamp['date']}",
             f"- CPU: {stamp['cpu_model']} (kind `{stamp['cpu_kind']}`)", f"- command: `{stamp['command']}`",
             *details, "", body_markdown.strip("\n")]
    return "\n".join(lines) + "\n"


def write_result(name: str, title: str, body_markdown: str, stamp: dict, *, note: str = "",
                 details: Sequence[str] = (), path: str | Path | None = None,
                 images: Sequence[str | Path] = ()) -> Path:
    """Write :func:`format_result` to ``path`` (default ``<results_dir()>/<name>.md``) and copy each PNG of
    ``images`` to ``<path's folder>/../img/``: under its own file name for the default file; for another file name
    the image's leading ``<name>`` becomes that file's stem (so a second results file of the same command, e.g.
    paper_study_rollout_kv.md, does not replace the first one's figures), and the body's ``../img/`` references
    follow. Returns the path written."""
    path = Path(path) if path else results_dir() / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    img_dir = path.parent.parent / "img"
    for src in map(Path, images):
        dest = src.name
        if path.stem != name and dest.startswith(name):
            dest = path.stem + dest[len(name):]
            body_markdown = body_markdown.replace(f"../img/{src.name}", f"../img/{dest}")
        img_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, img_dir / dest)
    path.write_text(format_result(title, body_markdown, stamp, note=note, details=details))
    return path


def add_results_doc_args(parser: argparse.ArgumentParser, name: str, *aliases: str) -> None:
    """``--results-doc PATH`` (default ``<results_dir()>/<name>.md``; ``''`` = none; ``aliases``: more option
    strings for it) and ``--no-results-doc``, both into ``args.results_doc``; read it with :func:`results_doc`."""
    default = results_dir() / f"{name}.md"
    parser.add_argument("--results-doc", *aliases, dest="results_doc", default=str(default), metavar="PATH",
                        help=f"the stamped Markdown results file this command writes (default: {shown(default)}; '' = none)")
    parser.add_argument("--no-results-doc", dest="results_doc", action="store_const", const="",
                        help="write no results file (tests, quick runs)")


def results_doc(args: argparse.Namespace) -> Path | None:
    """The results file ``args`` asks for (:func:`add_results_doc_args`), None for none."""
    return Path(args.results_doc) if args.results_doc else None
