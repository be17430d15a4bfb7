"""Checkpoints through fsspec (local paths, file://, s3:// via s3fs).

Layout of one checkpoint ``<checkpoint_dir>/step_000010/``::

    model.safetensors      HF-format policy weights (the names ``from_pretrained`` expects)
    config.json, tokenizer files, generation_config.json   copied from the model dir (a loadable HF model)
    optimizer.pt           torch.save of the optimizer + LR-scheduler state dicts
    rng.pt                 torch / numpy / python RNG states
    trainer_state.json     step, MLflow run id, clip bounds, KV scales, calibration state, anything small
    manifest.json          written LAST: every file with its size and sha256

A checkpoint is *complete* iff its manifest exists and every listed file has the listed size; ``latest_step`` only
considers complete checkpoints and ``load`` refuses one without a manifest, so a run killed mid-save (or a transient
storage error) can never be resumed from a partial checkpoint. Every write is retried on OSError with backoff
(transient S3 errors); pruning deletes a manifest before its files.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d{6,})$")


class CheckpointError(RuntimeError):
    pass


def _retry(fn: Callable[[], Any], *, what: str, attempts: int = 4, base_delay: float = 0.5):
    """``fn()``, retried on transient storage errors (OSError / TimeoutError: s3fs maps transient S3 errors to
    OSError subclasses) after ``base_delay * 2**i`` seconds; after ``attempts`` tries, a CheckpointError naming
    ``what`` and the last error."""
    import tenacity

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts), wait=tenacity.wait_exponential(multiplier=base_delay, min=0),
        retry=tenacity.retry_if_exception_type((OSError, TimeoutError)), reraise=True,
        sleep=lambda seconds: time.sleep(seconds))
    try:
        return retrying(fn)
    except (OSError, TimeoutError) as e:
        raise CheckpointError(f"{what}: failed after {attempts} attempts: {type(e).__name__}: {e}") from e


def rng_state() -> dict:
    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: Mapping) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


@dataclass
class Checkpoint:
    """What a checkpoint holds once loaded (tensors on CPU)."""

    step: int
    uri: str
    weights: dict  # HF name -> tensor
    optimizer: dict | None
    rng: dict | None
    state: dict = field(default_factory=dict)  # trainer_state.json


class CheckpointStore:
    """Checkpoints under one directory URI (``/abs/path``, ``file://...`` or ``s3://bucket/prefix``)."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None, storage_options: Mapping | None = None):
        import fsspec

        from storage.options import storage_options_for

        options = dict(storage_options or storage_options_for(uri, endpoint_url=endpoint_url))
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **options)
        self._proto = "" if "://" not in self.uri else self.uri.split("://", 1)[0] + "://"

    # -- paths ------------------------------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return f"{self.root}/step_{step:06d}"

    def step_uri(self, step: int) -> str:
        if self._proto == "file://" or not self._proto:
            return self.step_dir(step)
        return f"{self._proto}{self.step_dir(step)}"

    # -- writing ----------------------------------------------------------------------------------------------------
    def _write(self, path: str, data: bytes) -> None:
        def put():
            with self.fs.open(path, "wb") as f:
                f.write(data)
        _retry(put, what=f"write {path}")

    def save(self, step: int, *, weights: Mapping, model_files: Mapping[str, bytes] | None = None,
             optimizer: Mapping | None = None, rng: Mapping | None = None, state: Mapping | None = None) -> str:
        """Write checkpoint ``step`` (files first, manifest last) and return its URI. An existing checkpoint of the
        same step is invalidated (manifest removed) before being overwritten."""
        import torch
        from safetensors.torch import save as st_save

        d = self.step_dir(step)
        self._invalidate(step)
        _retry(lambda: self.fs.makedirs(d, exist_ok=True), what=f"mkdir {d}")
        blobs: dict[str, bytes] = dict(model_files or {})
        blobs["model.safetensors"] = st_save({k: v.detach().contiguous().cpu() for k, v in weights.items()},
                                             metadata={"format": "pt"})
        for name, obj in (("optimizer.pt", optimizer), ("rng.pt", rng)):
            if obj is not None:
                buf = io.BytesIO()
                torch.save(obj, buf)
                blobs[name] = buf.getvalue()
        blobs["trainer_state.json"] = json.dumps({"step": step, **(state or {})}, indent=1, default=float).encode()
        files = {}
        for name, data in blobs.items():
            self._write(f"{d}/{name}", data)
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {"step": step, "files": files, "created": time.time(), "format": 1}
        self._write(f"{d}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        return self.step_uri(step)

    def _invalidate(self, step: int) -> None:
        m = f"{self.step_dir(step)}/{MANIFEST}"
        if self.fs.exists(m):
            _retry(lambda: self.fs.rm(m), what=f"remove {m}")

    def prune(self, keep_last_k: int | None) -> list[int]:
        """Delete all but the newest ``keep_last_k`` complete checkpoints (manifest first); returns deleted steps."""
        if not keep_last_k:
            return []
        steps = self.complete_steps()
        doomed = steps[:-keep_last_k]
        for s in doomed:
            self._invalidate(s)
            _retry(lambda s=s: self.fs.rm(self.step_dir(s), recursive=True), what=f"remove {self.step_dir(s)}")
        return doomed

    # -- discovery / reading ------------------------------------------------------------------------------------------
    def _manifest(self, step: int) -> dict | None:
        path = f"{self.step_dir(step)}/{MANIFEST}"
        try:
            with self.fs.open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def is_complete(self, step: int) -> bool:
        manifest = self._manifest(step)
        if manifest is None or manifest.get("step") != step:
            return False
        d = self.step_dir(step)
        try:
            return all(self.fs.size(f"{d}/{name}") == meta["size"] for name, meta in manifest["files"].items())
        except FileNotFoundError:
            return False

    def all_steps(self) -> list[int]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for e in entries:
            m = _STEP_DIR.search(e.rstrip("/"))
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def complete_steps(self) -> list[int]:
        self.fs.invalidate_cache()
        return [s for s in self.all_steps() if self.is_complete(s)]

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def _read(self, path: str) -> bytes:
        def get():
            with self.fs.open(path, "rb") as f:
                return f.read()
        return _retry(get, what=f"read {path}")

    def load(self, step: int | None = None, *, verify: bool = True) -> Checkpoint:
        """Load checkpoint ``step`` (default: the latest complete one). Raises CheckpointError when it has no
        manifest, a file's size/hash differs from it, or there is no complete checkpoint at all."""
        import torch
        from safetensors.torch import load as st_load

        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{self.uri}: no complete checkpoint (none with a {MANIFEST})")
        manifest = self._manifest(step)
        if manifest is None:
            raise CheckpointError(f"{self.step_uri(step)}: no {MANIFEST}; refusing an incomplete checkpoint")
        d = self.step_dir(step)
        blobs = {}
        for name, meta in manifest["files"].items():
            if name not in ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"):
                continue
            data = self._read(f"{d}/{name}")
            if verify and (len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]):
                raise CheckpointError(f"{self.step_uri(step)}/{name}: content does not match {MANIFEST}")
            blobs[name] = data

        def tload(name):
            return torch.load(io.BytesIO(blobs[name]), weights_only=False) if name in blobs else None

        return Checkpoint(step=step, uri=self.step_uri(step), weights=st_load(blobs["model.safetensors"]),
                          optimizer=tload("optimizer.pt"), rng=tload("rng.pt"),
                          state=json.loads(blobs["trainer_state.json"]))

    def load_state(self, step: int) -> dict:
        """The small trainer_state.json of a complete checkpoint (MLflow run id, step, clip bounds, ...)."""
        if not self.is_complete(step):
            raise CheckpointError(f"{self.step_uri(step)}: incomplete checkpoint (no valid {MANIFEST})")
        return json.loads(self._read(f"{self.step_dir(step)}/trainer_state.json"))

    def download_model(self, step: int, local_dir: str | Path) -> Path:
        """Copy the HF-format part (weights + config + tokenizer) of a complete checkpoint to ``local_dir``."""
        manifest = self._manifest(step)
        if manifest is None:
            raise CheckpointError(f"{self.step_uri(step)}: no {MANIFEST}; refusing an incomplete checkpoint")
        out = Path(local_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in manifest["files"]:
            if name not in ("optimizer.pt", "rng.pt", "trainer_state.json"):
                (out / name).write_bytes(self._read(f"{self.step_dir(step)}/{name}"))
        return out


def model_files(model_dir: str | Path) -> dict[str, bytes]:
    """The non-weight files of an HF model dir (config, generation config, tokenizer) to copy into a checkpoint."""
    out = {}
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt")) and not p.name.startswith("."):
            if p.name.endswith(".json") or p.name.endswith(".txt") or p.name.endswith(".jinja") or p.name == "merges":
                out[p.name] = p.read_bytes()
    return out
