"""tools.results: the stamp (commit, dirty tree, date, CPU, command line) taken from a real git repository, the
results file's layout, its figures, and the --results-doc / --no-results-doc options."""
import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8core.cpu import cpu_caps
from tools import results
from tools.results import add_results_doc_args, format_result, results_doc, stamp, write_result


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / "a.py").write_text("x = 1\n")
    (r / "b.py").write_text("y = 1\n")
    _git(r, "add", "a.py", "b.py")
    _git(r, "commit", "-q", "-m", "first")
    return r


def test_stamp_of_a_clean_and_of_a_dirty_tree(repo):
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "new.py").write_text("untracked\n")  # untracked files do not make the tree dirty
    st = stamp("experiments.learning", ["--seeds", "0", "a b"], repo=repo)
    assert st["commit"] == head and st["dirty_files"] == []
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", st["date"])
    assert (st["cpu_model"], st["cpu_kind"]) == (cpu_caps().model, cpu_caps().kind)
    exe = Path(sys.executable)
    exe = exe.relative_to(results.ROOT) if exe.is_relative_to(results.ROOT) else exe
    assert st["writer"] == f"{exe} -m experiments.learning"
    assert st["command"] == f"{exe} -m experiments.learning --seeds 0 'a b'"  # the exact command line, shell-quoted
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "docs" / "results" / "x.md").write_text("a table\n")
    _git(repo, "add", "docs/results/x.md")
    _git(repo, "commit", "-q", "-m", "a results file")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "docs" / "results" / "x.md").write_text("another command's new table\n")  # an output, not code
    assert stamp("experiments.learning", [], repo=repo)["commit"] == head
    (repo / "b.py").write_text("y = 2\n")
    dirty = stamp("experiments.learning", [], repo=repo)
    assert dirty["commit"] == head + "+dirty" and dirty["dirty_files"] == ["b.py"]
    assert stamp("m", [], repo=repo.parent)["commit"] == "unknown"  # not a git repository


def _stamp(dirty=()):
    return {"commit": "abc1234" + ("+dirty" if dirty else ""), "dirty_files": list(dirty),
            "date": "2026-12-03 08:41 UTC", "cpu_kind": "avx2", "cpu_model": "AMD EPYC",
            "writer": ".venv/bin/python -m bench", "command": ".venv/bin/python -m bench --steps 4"}


def test_results_file_layout():
    text = format_result("Bench: results", "| a |\n|---|\n", _stamp(["b.py", "c.py"]), note="How to read it.",
                         details=["- torch 2.13"])
    assert text == ("# Bench: results\n\n"
                    "Written by `.venv/bin/python -m bench`; the next run of that command overwrites this file.\n\n"
                    "How to read it.\n\n"
                    "- commit: `abc1234+dirty` (uncommitted changes in b.py, c.py)\n"
                    "- date: 2026-12-03 08:41 UTC\n"
                    "- CPU: AMD EPYC (kind `avx2`)\n"
                    "- command: `.venv/bin/python -m bench --steps 4`\n"
                    "- torch 2.13\n\n"
                    "| a |\n|---|\n")
    assert "How to read" not in format_result("T", "body", _stamp()) and "- commit: `abc1234`\n" in \
        format_result("T", "body", _stamp())


def test_write_result_default_path_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path / "docs" / "results"))
    png = tmp_path / "plots" / "paper_study_intervals.png"
    png.parent.mkdir()
    png.write_bytes(b"\x89PNG fake")
    body = "table\n\n![k](../img/paper_study_intervals.png)"
    out = write_result("paper_study", "Study", body, _stamp(), images=[png])
    assert out == tmp_path / "docs" / "results" / "paper_study.md"
    assert (tmp_path / "docs" / "img" / "paper_study_intervals.png").read_bytes() == b"\x89PNG fake"
    assert out.read_text().endswith("table\n\n![k](../img/paper_study_intervals.png)\n")
    # another file of the same command: its figures get its stem, and its references follow
    other = write_result("paper_study", "Study", body, _stamp(), images=[png],
                         path=tmp_path / "docs" / "results" / "paper_study_rollout_kv.md")
    assert (tmp_path / "docs" / "img" / "paper_study_rollout_kv_intervals.png").exists()
    assert "![k](../img/paper_study_rollout_kv_intervals.png)" in other.read_text()


def test_results_doc_options(tmp_path, monkeypatch):
    monkeypatch.delenv(results.RESULTS_DIR_ENV, raising=False)
    p = argparse.ArgumentParser()
    add_results_doc_args(p, "scaling")
    assert results_doc(p.parse_args([])) == results.ROOT / "docs" / "results" / "scaling.md"
    assert results_doc(p.parse_args(["--results-doc", str(tmp_path / "s.md")])) == tmp_path / "s.md"
    assert results_doc(p.parse_args(["--results-doc", ""])) is None
    assert results_doc(p.parse_args(["--no-results-doc"])) is None
    alias = argparse.ArgumentParser()
    add_results_doc_args(alias, "mismatch", "--out")
    assert results_doc(alias.parse_args(["--out", "x.md"])) == Path("x.md")
