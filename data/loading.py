"""Train / validation data: jsonl or parquet files loaded with HF ``datasets`` from local paths, file:// or s3://,
or hub datasets ``ORG/NAME[@REVISION]`` from the Hugging Face cache (storage/hub.py tells the two apart and finds the
snapshot; ``load_hub_split`` reads one split of one subset of it).

A split is any file with a question column and an answer column (names configurable: GSM8K's ``question`` /
``answer`` or OpenMathInstruct-2's ``problem`` / ``expected_answer``). Loading fails early with an error naming the
file (missing, unreadable, unknown format) or the column (absent, with the columns that exist). In a JSON-lines file
the error also names the line: ``<file>:<line>: <what is wrong>`` for a line that is not valid JSON or not an object,
and for a line without (or with a null) question / answer key. While loading, the lines are scanned only when
``datasets`` could not read the file or a column is absent or has a null, so a good file is parsed once there; the
command line's ``check_local_files`` scans a bounded prefix before the run starts.

Prompt order is a pure function of (seed, step): ``step_indices`` draws from a per-epoch permutation, so a run resumed
at step s sees exactly the prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from configs.schema import DEFAULT_TASK
from storage.options import storage_options_for

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file and, where relevant, the column."""


def _strip_file(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _format_of(path: str) -> str:
    for suffix, fmt in _FORMATS.items():
        if path.endswith(suffix):
            return fmt
    raise DataError(f"{path}: unknown dataset format (expected one of {', '.join(_FORMATS)})")


@contextmanager
def _datasets_json_logger_off() -> Iterator[None]:
    """``datasets``' JSON builder logs its pyarrow error (``Failed to load JSON ... in row 4``) before raising; the
    DataError raised instead names the file and line, so that log record is dropped while one file is read."""
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _json_lines_error(local: str, path: str, keys: Mapping[str, str],
                      max_bytes: int | None = None) -> DataError | None:
    """The first problem in the JSON-lines file ``local`` (named ``path`` in the message), as ``<path>:<line>: ...``:
    bytes that are not UTF-8, a line that is not valid JSON or not an object, a line without (or with a null) one of
    ``keys`` ({role: column}). A file that starts with ``[`` is one JSON document: its parse error's line. None when
    nothing is wrong line by line. With ``max_bytes`` only the lines that start within the first ``max_bytes`` are
    read (a JSON document longer than that is not parsed)."""
    with open(local, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        if max_bytes is not None and Path(local).stat().st_size > max_bytes:
            return None
        try:
            json.loads(Path(local).read_bytes())
        except json.JSONDecodeError as e:
            return DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})")
        except UnicodeDecodeError as e:
            return DataError(f"{path}: not UTF-8 text: {e.reason} at byte {e.start}")
        return None
    with open(local, "rb") as f:
        for n, raw in enumerate(f, 1):
            if max_bytes is not None and f.tell() - len(raw) >= max_bytes:
                break
            try:
                line = raw.decode("utf-8").rstrip("\r\n")  # a column past the end names the line's end, not 1
            except UnicodeDecodeError as e:
                return DataError(f"{path}:{n}: not UTF-8 text: {e.reason} at byte {e.start} of the line")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return DataError(f"{path}:{n}: not valid JSON: {e.msg} (column {e.colno})")
            if not isinstance(row, dict):
                return DataError(f"{path}:{n}: not a JSON object (a {type(row).__name__}); each line must be one row")
            for role, col in keys.items():
                if col not in row:
                    return DataError(f"{path}:{n}: no {role} key {col!r} (set data.{role}_key); keys on this line: "
                                     f"{sorted(row)}")
                if row[col] is None:
                    return DataError(f"{path}:{n}: {role} key {col!r} is null")
                if not _scalar(row[col]):
                    return DataError(f"{path}:{n}: {role} key {col!r} is {_kind(row[col])}; expected text or a number")
    return None


def _scalar(v) -> bool:
    """Text or a number: what a question and an answer may be (a bool, list or object is a malformed row)."""
    return isinstance(v, (str, int, float)) and not isinstance(v, bool)


def _kind(v) -> str:
    name = {list: "a list", dict: "an object", bool: "true/false"}.get(type(v), f"a {type(v).__name__}")
    text = json.dumps(v) if isinstance(v, (list, dict, bool)) else repr(v)
    return f"{name} ({text[:60]}{'...' if len(text) > 60 else ''})"


def _check_columns(ds, local: str, path: str, fmt: str, keys: Mapping[str, str]) -> None:
    """Both columns present and without nulls (a JSON line without the key reads as a null): else a DataError naming
    the file, the column and, for JSON lines, the line."""
    for role, col in keys.items():
        nulls = ds.data.column(col).null_count if col in ds.column_names else None
        if nulls == 0:
            _check_values(ds, local, path, fmt, keys, role, col)
            continue
        if fmt == "json" and (line_error := _json_lines_error(local, path, keys)) is not None:
            raise line_error
        key = f"data.{role}_key"
        if nulls is None:
            raise DataError(f"{path}: no {role} column {col!r} (set {key}); columns present: {ds.column_names}")
        first = next(i for i, v in enumerate(ds[col]) if v is None)
        raise DataError(f"{path}: row {first}: {role} column {col!r} is null ({nulls} null rows)")


def _check_values(ds, local: str, path: str, fmt: str, keys: Mapping[str, str], role: str, col: str) -> None:
    """Every value of column ``col`` is text or a number: a list or object (a JSON line's ``"answer": ["4"]``) is a
    DataError naming the file and the line (JSON lines) or the row."""
    feature = ds.features[col]
    if getattr(feature, "dtype", None) in _SCALAR_DTYPES:
        return
    if fmt == "json" and (line_error := _json_lines_error(local, path, keys)) is not None:
        raise line_error
    first, value = next(((i, v) for i, v in enumerate(ds[col]) if not _scalar(v)), (None, None))
    if first is not None:
        raise DataError(f"{path}: row {first}: {role} column {col!r} is {_kind(value)}; expected text or a number")


PREFLIGHT_SCAN_BYTES = 64 << 20  # check_local_files reads at most this much of each JSON-lines file


def check_local_files(data_cfg, paths: Mapping[str, str]) -> None:
    """The cheap half of loading, for the command line to run before Prefect, Ray or a worker starts: each local (or
    file://) dataset of ``paths`` ({config key: path}) exists with a known format, and the lines of a JSON-lines file
    that start in its first ``PREFLIGHT_SCAN_BYTES`` are valid rows with both keys (the errors ``load_split`` gives,
    ``<file>:<line>: ...``). Hub datasets, s3:// files and ``embedded`` are left to the run, which loads every file
    in full anyway (a fault past the scanned prefix fails there, with the same message)."""
    from configs.schema import EMBEDDED
    from storage.hub import hub_dataset

    keys = {"question": data_cfg.question_key, "answer": data_cfg.answer_key}
    for path in paths.values():
        if path == EMBEDDED or hub_dataset(path) is not None or "://" in _strip_file(path):
            continue
        fmt, local = _format_of(path), _strip_file(path)
        if not Path(local).is_file():
            raise DataError(f"{path}: dataset file not found")
        error = _json_lines_error(local, path, keys, max_bytes=PREFLIGHT_SCAN_BYTES) if fmt == "json" else None
        if error is not None:
            raise error


_SCALAR_DTYPES = {"string", "large_string", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                  "float16", "float32", "float64"}


def load_split(path: str, *, question_key: str = "question", answer_key: str = "answer",
               endpoint_url: str | None = None):
    """Load one split as a ``datasets.Dataset`` with (at least) the two named columns.

    Local / file:// files go through ``Dataset.from_json`` / ``from_parquet``; s3:// files are copied through fsspec
    (s3fs) to a local temp file first (HF offline mode blocks ``load_dataset`` on remote URLs).
    """
    import datasets
    import fsspec

    fmt = _format_of(path)
    options = storage_options_for(path, endpoint_url=endpoint_url)
    local = _strip_file(path)
    tmpdir = None
    try:
        if path.startswith("s3://") or "://" in local:
            fs, remote = fsspec.core.url_to_fs(path, **options)
            if not fs.exists(remote):
                raise DataError(f"{path}: dataset file not found")
            tmpdir = tempfile.TemporaryDirectory(prefix="fp8grpo-data-")
            local = str(Path(tmpdir.name) / Path(remote).name)
            fs.get(remote, local)
        elif not Path(local).is_file():
            raise DataError(f"{path}: dataset file not found")
        keys = {"question": question_key, "answer": answer_key}
        try:
            reader = datasets.Dataset.from_json if fmt == "json" else datasets.Dataset.from_parquet
            with _datasets_json_logger_off():
                ds = reader(local, keep_in_memory=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the file name (and line)
            line_error = _json_lines_error(local, path, keys) if fmt == "json" else None
            raise (line_error or DataError(f"{path}: cannot read as {fmt}: {type(e).__name__}: {e}")) from e
        _check_columns(ds, local, path, fmt, keys)
    finally:
        if tmpdir is not None:
            tmpdir.cleanup()
    if len(ds) == 0:
        raise DataError(f"{path}: dataset is empty")
    return ds


def load_hub_split(path: str, *, key: str, split_key: str, split: str, subset: str | None,
                   question_key: str = "question", answer_key: str = "answer", allow_downloads: bool = False):
    """One split of a hub dataset ``ORG/NAME[@REVISION]`` (data key ``key``), read with ``datasets`` from its
    snapshot in the Hugging Face cache. A missing dataset, subset, split or column fails in one line naming its key
    (``key``, ``data.subset``, ``split_key``, ``data.question_key`` / ``data.answer_key``)."""
    import datasets

    from storage.hub import hub_dataset, resolve

    repo_id, revision = hub_dataset(path) or (path, "main")
    snap = resolve(repo_id, key=key, revision=revision, repo_type="dataset", allow_downloads=allow_downloads)
    where = f"{repo_id} ({'subset ' + subset + ', ' if subset else ''}split {split})"
    try:
        ds = datasets.load_dataset(str(snap.path), name=subset, split=split, keep_in_memory=True)
    except ValueError as e:  # an unknown subset or split: name the key and what exists
        raise _hub_layout_error(snap.path, repo_id, split_key, split, subset) or DataError(
            f"{key}: {where}: cannot read: {str(e).splitlines()[0]}") from e
    _check_columns(ds, "", where, "parquet", {"question": question_key, "answer": answer_key})
    if len(ds) == 0:
        raise DataError(f"{split_key}: {where} is empty")
    return ds


def _hub_layout_error(local: Path, repo_id: str, split_key: str, split: str, subset: str | None) -> DataError | None:
    """The DataError for a subset or split the snapshot at ``local`` lacks (with the ones it has), else None."""
    import datasets

    subsets = datasets.get_dataset_config_names(str(local))
    if subset is None and len(subsets) > 1:
        return DataError(f"data.subset: {repo_id} has several subsets, name one: {subsets}")
    if subset is not None and subset not in subsets:
        return DataError(f"data.subset: {subset!r} is not a subset of {repo_id} (subsets: {subsets})")
    splits = datasets.get_dataset_split_names(str(local), subset)
    if split not in splits:
        return DataError(f"{split_key}: {split!r} is not a split of {repo_id}"
                         f"{' subset ' + subset if subset else ''} (splits: {splits})")
    return None


def load_data(path: str, data_cfg, *, key: str, split_key: str, split: str, allow_downloads: bool = False):
    """A data key's rows: a hub dataset (``load_hub_split``) or a file (``load_split``), by ``storage.hub``'s rule."""
    from storage.hub import hub_dataset

    cols = dict(question_key=data_cfg.question_key, answer_key=data_cfg.answer_key)
    if hub_dataset(path) is not None:
        return load_hub_split(path, key=key, split_key=split_key, split=split, subset=data_cfg.subset,
                              allow_downloads=allow_downloads, **cols)
    return load_split(path, endpoint_url=data_cfg.s3_endpoint_url, **cols)


def rows(ds, *, question_key: str, answer_key: str, indices, task: str | None = None) -> list[dict]:
    """Rows as {'id', 'question', 'answer'} dicts (answers as strings; ``id`` = the row's index in the file, so
    per-prompt results pair across runs) for the given indices; with ``task`` each row also carries it
    (``data.task``: the task whose reward scores its responses, rewards/registry.py)."""
    idx = [int(i) for i in indices]
    sub = ds.select(idx)
    extra = {} if task is None else {"task": task}
    return [{"id": i, "question": str(q), "answer": str(a), **extra}
            for i, q, a in zip(idx, sub[question_key], sub[answer_key], strict=True)]


def step_indices(n_rows: int, *, step: int, num_prompts: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Row indices of the prompts for RL step ``step`` (0-based): consecutive slices of per-epoch permutations
    (permutation e uses seed ``seed + e``); wraps across epochs, so any step is computable without history."""
    out = np.empty(num_prompts, dtype=np.int64)
    start = step * num_prompts
    for i in range(num_prompts):
        epoch, pos = divmod(start + i, n_rows)
        order = np.random.default_rng(seed + epoch).permutation(n_rows) if shuffle else np.arange(n_rows)
        out[i] = order[pos]
    return out


class PromptSource:
    """Both splits of a run; rows carry ``task`` (``data.task``) so the reward and validation pick its verifier."""

    def __init__(self, train, validation, *, question_key: str, answer_key: str, seed: int, shuffle: bool = True,
                 task: str = DEFAULT_TASK):
        self.train, self.validation = train, validation
        self.question_key, self.answer_key = question_key, answer_key
        self.seed, self.shuffle, self.task = seed, shuffle, task

    @classmethod
    def from_config(cls, data_cfg, *, train_path: str, validation_path: str, seed: int,
                    allow_downloads: bool = False) -> PromptSource:
        """Both splits: files, or hub datasets (``data_cfg.train_split`` / ``validation_split``, ``subset``)."""
        train = load_data(train_path, data_cfg, key="data.train_path", split_key="data.train_split",
                          split=data_cfg.train_split, allow_downloads=allow_downloads)
        validation = load_data(validation_path, data_cfg, key="data.validation_path",
                               split_key="data.validation_split", split=data_cfg.validation_split,
                               allow_downloads=allow_downloads)
        return cls(train, validation, question_key=data_cfg.question_key, answer_key=data_cfg.answer_key, seed=seed,
                   shuffle=data_cfg.shuffle, task=data_cfg.task)

    def train_rows(self, step: int, num_prompts: int) -> list[dict]:
        idx = step_indices(len(self.train), step=step, num_prompts=num_prompts, seed=self.seed, shuffle=self.shuffle)
        return rows(self.train, question_key=self.question_key, answer_key=self.answer_key, indices=idx,
                    task=self.task)

    def validation_rows(self, max_samples: int) -> list[dict]:
        n = min(max_samples, len(self.validation))
        return rows(self.validation, question_key=self.question_key, answer_key=self.answer_key, indices=range(n),
                    task=self.task)


def summary(ds_by_name: Mapping[str, object]) -> dict:
    return {f"data/{name}_rows": len(ds) for name, ds in ds_by_name.items()}
