"""Models and datasets named by their Hugging Face Hub id (``ORG/NAME``), found in the user's Hugging Face cache.

The cache is the user's own: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else huggingface_hub's default
(``~/.cache/huggingface/hub``), read when a name is resolved (not when huggingface_hub was imported). Runs are
offline by default: a name resolves only to a snapshot already in that cache; ``hub.allow_downloads: true`` lets the
driver (and workers on other nodes) download it.

Pinning: the driver resolves a name once to a commit hash and its snapshot directory (``resolve``). Everything on
the driver's node reads that directory: the trainer (``PolicyWorker``) and the rollout engines of a local Ray get its
path, and checkpoints copy its config / tokenizer files, which the FP8 export (tools/fp8_export.py) then reads. On a
``ray.address`` cluster the workers get ``ORG/NAME@<commit>`` instead and resolve that pinned commit in their own
node's cache (``local_model_dir``), so every node loads the same files or fails naming the commit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from configs.schema import EMBEDDED, Config, ConfigError

DOWNLOADS_KEY = "hub.allow_downloads"
_REPO = r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
_HUB_REF = re.compile(rf"^{_REPO}(?:@(?P<rev>[\w.-]+))?$")  # ORG/NAME or ORG/NAME@REVISION
_PINNED = re.compile(rf"^{_REPO}@(?P<rev>[0-9a-f]{{40}})$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub would pick it from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_hub_id(name: str) -> bool:
    """``ORG/NAME`` and not a local path that exists (a local directory of that name wins)."""
    m = _HUB_REF.match(name)
    return m is not None and m["rev"] is None and not Path(name).exists()


def hub_dataset(path: str) -> tuple[str, str] | None:
    """``(repo_id, revision)`` when a data key names a hub dataset ``ORG/NAME[@REVISION]``, None when it names a
    file: a known file suffix, a URI or an existing local path is a file."""
    m = _HUB_REF.match(path)
    if m is None or "://" in path or path.endswith(_FILE_SUFFIXES) or Path(path).exists():
        return None
    return m["repo"], m["rev"] or "main"


@dataclass(frozen=True)
class Snapshot:
    """A hub repo resolved in the cache: the id, the revision asked for, the commit it points to, the files."""

    repo_id: str
    revision: str
    commit: str
    path: Path

    @property
    def pinned(self) -> str:
        """``ORG/NAME@<commit>``: what a worker on another node resolves (``local_model_dir``)."""
        return f"{self.repo_id}@{self.commit}"


@contextmanager
def _online(allow: bool) -> Iterator[None]:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: with downloads allowed, lift it for this call."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = before and not allow
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def resolve(repo_id: str, *, key: str, revision: str = "main", repo_type: str = "model",
            allow_downloads: bool = False) -> Snapshot:
    """The snapshot of ``repo_id`` at ``revision`` (a branch, tag or commit) in the hub cache, downloaded first when
    ``allow_downloads``. Anything missing raises a one-line ConfigError naming ``key``, the cache and the switch."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        with _online(allow_downloads):
            path = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=str(cache),
                                          local_files_only=not allow_downloads))
    except Exception as e:  # noqa: BLE001 - not found / incomplete / gated / no network: one line naming the key
        raise ConfigError(_not_found(key, repo_id, revision, repo_type, cache, allow_downloads, e)) from e
    return Snapshot(repo_id=repo_id, revision=revision, commit=path.name, path=path)


def _not_found(key: str, repo_id: str, revision: str, repo_type: str, cache: Path, allowed: bool,
               error: Exception) -> str:
    kind = "dataset" if repo_type == "dataset" else "model"
    if allowed:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        return (f"{key}: hub {kind} {repo_id} (revision {revision}) could not be downloaded into the Hugging Face "
                f"cache {cache}: {type(error).__name__}: {why}")
    return (f"{key}: hub {kind} {repo_id} (revision {revision}) is not in the Hugging Face cache {cache} and "
            f"downloads are off (set {DOWNLOADS_KEY}=true to download it, or HF_HUB_CACHE / HF_HOME to the cache "
            "that holds it)")


def downloads_allowed_here() -> bool:
    """Whether this process may download (the run's HF_HUB_OFFLINE, which the driver set from hub.allow_downloads
    and passed to every worker)."""
    return os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() in ("0", "false", "no", "off")


def local_model_dir(model: str | Path) -> Path:
    """A worker's model directory: ``model`` itself when it is a path, or the snapshot of a pinned
    ``ORG/NAME@<commit>`` in this node's cache (see the module docstring)."""
    m = _PINNED.match(str(model))
    if m is None or Path(model).is_dir():
        return Path(model)
    return resolve(m["repo"], key="policy.model_name", revision=m["rev"], allow_downloads=downloads_allowed_here()).path


def resolve_config(cfg: Config) -> dict[str, Snapshot]:
    """The recipe's hub names pinned, ``{key: Snapshot}`` for ``policy.model_name``, ``data.train_path`` and
    ``data.validation_path`` where they name a hub repo (nothing for local paths and ``embedded``). Raises a
    one-line ConfigError naming the key for a name the cache lacks (downloads off), and for
    ``policy.model_revision`` set with a model that is not a hub id."""
    p, allow = cfg.policy, cfg.hub.allow_downloads
    out: dict[str, Snapshot] = {}
    if is_hub_id(p.model_name):
        out["policy.model_name"] = resolve(p.model_name, key="policy.model_name", revision=p.model_revision,
                                           allow_downloads=allow)
    elif p.model_revision != "main":
        raise ConfigError(f"policy.model_revision: {p.model_revision!r} applies to a hub model id (ORG/NAME), but "
                          f"policy.model_name is {p.model_name!r}")
    elif p.model_name != EMBEDDED and not Path(p.model_name).is_dir():
        raise ConfigError(f"policy.model_name: {p.model_name} is neither a local Hugging Face model directory nor a "
                          "hub id ORG/NAME")
    for key in ("train_path", "validation_path"):
        ref = hub_dataset(getattr(cfg.data, key))
        if ref is not None:
            out[f"data.{key}"] = resolve(ref[0], key=f"data.{key}", revision=ref[1], repo_type="dataset",
                                         allow_downloads=allow)
    return out
