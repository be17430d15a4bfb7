"""Validation sets beyond the main one (``evaluation.sets``): resolve, check and load them before any worker starts.

A set is ``embedded:digits<N>`` (the addition task with two N-digit operands: the harder / out-of-range set of the
embedded workload, whose RL prompts have 2-3 digits and whose SFT saw 2-4) or a jsonl / parquet file (local,
file://, s3://) in any question/answer layout (GSM8K's ``question`` / ``answer`` with ``#### 42``, or named columns).

Embedded sets are generated once, deterministically (fixed seed per N), under
``<bootstrap.assets_dir>/addition/data/eval/digits<N>.jsonl``; operand pairs that appear in the embedded train /
validation / SFT files of that directory are excluded, so an evaluation prompt is never one the model trained on.
Every row carries ``id`` (its index in the file) and ``task`` (the verifier), so per-prompt results pair across runs.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from configs.schema import EMBEDDED, Config, ConfigError, embedded_set_digits
from data.loading import DataError, load_split, rows
from rewards import addition_task

EMBEDDED_SET_SEED = 9_000  # + N: the rows of embedded:digits<N> are the same on every machine
EMBEDDED_SET_ROWS = 1_000  # rows written per embedded set (a set uses its first evaluation.sets[i].max_samples)


def _local(path: str) -> str | None:
    """The local file path of ``path`` (None for remote URLs and embedded sets)."""
    if path.startswith(EMBEDDED) or ("://" in path and not path.startswith("file://")):
        return None
    return path[len("file://"):] if path.startswith("file://") else path


def check_eval_paths(cfg: Config) -> None:
    """Fail fast (before assets, Prefect or workers) on a local evaluation-set file that does not exist, naming the
    key. Remote files are checked when they are loaded (still before any worker starts)."""
    for i, s in enumerate(cfg.evaluation.sets):
        local = _local(s.path)
        if local is not None and not Path(local).is_file():
            raise ConfigError(f"evaluation.sets[{i}].path: {s.path}: no such file (set {s.name!r})")


def _pairs_in(path: Path) -> set[tuple[int, int]]:
    out = set()
    if path.exists():
        for line in path.read_text().splitlines():
            nums = re.findall(r"\d+", json.loads(line)["question"]) if line.strip() else []
            if len(nums) == 2:
                a, b = int(nums[0]), int(nums[1])
                out.add((min(a, b), max(a, b)))
    return out


def embedded_set_path(assets_dir: str | Path, digits: int) -> Path:
    return Path(assets_dir) / "addition" / "data" / "eval" / f"digits{digits}.jsonl"


def ensure_embedded_set(assets_dir: str | Path, digits: int, *, rows_count: int = EMBEDDED_SET_ROWS) -> Path:
    """Write ``embedded:digits<N>`` once (question / answer / clean solution; no operand pair of the embedded
    train, validation or SFT files); later calls return the file as it is."""
    out = embedded_set_path(assets_dir, digits)
    if out.exists():
        return out
    data_dir = out.parent.parent
    seen = set().union(*(_pairs_in(data_dir / f"{n}.jsonl") for n in ("train", "validation", "sft")))
    spec = addition_task.AdditionSpec(min_digits=digits, max_digits=digits)
    rng = random.Random(EMBEDDED_SET_SEED + digits)
    space = (9 * 10 ** (digits - 1) if digits > 1 else 10) ** 2 // 2  # unordered pairs, roughly
    want = min(rows_count, max(1, space - len(seen)))
    found: list[dict] = []
    for _ in range(200 * want):
        if len(found) == want:
            break
        row = addition_task.make_problem(rng, spec)
        a, b = (int(v) for v in re.findall(r"\d+", row["question"]))
        pair = (min(a, b), max(a, b))
        if pair not in seen:
            seen.add(pair)
            found.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in found))
    tmp.replace(out)
    return out


def load_eval_sets(cfg: Config) -> dict[str, list[dict]]:
    """``{name: rows}`` of ``evaluation.sets`` (the first ``max_samples`` rows each, at most grpo.max_val_samples,
    with ``id`` and ``task``). Errors
    name the key (``evaluation.sets[i].path`` / ``.question_key`` / ``.answer_key``) and the file."""
    out: dict[str, list[dict]] = {}
    for i, s in enumerate(cfg.evaluation.sets):
        key = f"evaluation.sets[{i}]"
        task = s.task or cfg.data.task
        digits = embedded_set_digits(s.path)
        if digits is not None:
            path, qk, ak = str(ensure_embedded_set(cfg.bootstrap.assets_dir, digits)), "question", "answer"
        else:
            path = s.path
            qk, ak = s.question_key or cfg.data.question_key, s.answer_key or cfg.data.answer_key
        try:
            ds = load_split(path, question_key=qk, answer_key=ak, endpoint_url=cfg.data.s3_endpoint_url)
        except DataError as e:
            msg = str(e).replace("(set data.question_key)", f"(set {key}.question_key)")
            msg = msg.replace("(set data.answer_key)", f"(set {key}.answer_key)")
            raise DataError(f"{key}.path: {msg}") from e
        n = min(s.max_samples, cfg.grpo.max_val_samples, len(ds))  # grpo.max_val_samples caps every set
        out[s.name] = rows(ds, question_key=qk, answer_key=ak, indices=range(n), task=task)
    return out
