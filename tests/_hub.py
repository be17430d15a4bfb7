"""A Hugging Face hub cache in the hub's own layout (``models--ORG--NAME/{blobs,snapshots/<rev>,refs/main}``), for
tests that name models and datasets by hub id offline. Tests load it with ``sys.path`` (pytest runs with
``--import-mode=importlib``): ``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))``."""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes], *, rev: str | None = None,
                 ref: str = "main") -> str:
    """Write ``files`` as the snapshot ``rev`` (default: a hash of the contents) of ``repo_id``: blobs named by their
    sha256, snapshot entries as relative symlinks to them (as huggingface_hub writes them), ``refs/<ref>`` = rev."""
    folder = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    rev = rev or hashlib.sha1(b"".join(sorted(files.values())) + repo_id.encode()).hexdigest()
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        entry = folder / "snapshots" / rev / name
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.symlink_to(os.path.relpath(blob, entry.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(rev)
    return rev


def add_model(cache: Path, repo_id: str, model_dir: Path, **kw) -> str:
    """A local model directory's files (not hidden ones) as a hub model snapshot; returns its revision."""
    files = {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()
             and not p.name.startswith(".")}
    return add_snapshot(cache, "model", repo_id, files, **kw)


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def add_dataset(cache: Path, repo_id: str, subsets: dict[str | None, dict[str, list[dict]]], **kw) -> str:
    """A hub dataset snapshot: ``{subset: {split: rows}}`` as parquet files. One subset named None is the hub's
    plain layout (``data/<split>-00000-of-00001.parquet``); named subsets get ``<subset>/<split>-...`` files and the
    README ``configs:`` block that declares them (as GSM8K's card does)."""
    files, card = {}, ["---", "configs:"]
    for subset, splits in subsets.items():
        folder = subset or "data"
        if subset is not None:
            card += [f"- config_name: {subset}", "  data_files:"]
        for split, rows in splits.items():
            files[f"{folder}/{split}-00000-of-00001.parquet"] = _parquet(rows)
            if subset is not None:
                card += [f"  - split: {split}", f"    path: {folder}/{split}-*"]
    if any(s is not None for s in subsets):
        files["README.md"] = "\n".join([*card, "---", ""]).encode()
    return add_snapshot(cache, "dataset", repo_id, files, **kw)
