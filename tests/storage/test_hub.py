"""Models named by hub id: found in a Hugging Face cache in the hub's layout (offline), pinned to the commit their
revision points to, and a name the cache lacks fails in one line naming the key, the cache and the switch."""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hub import add_model, add_snapshot  # noqa: E402

from configs.schema import ConfigError, config_from_dict  # noqa: E402
from process.env import apply_env, cache_env  # noqa: E402
from storage.hub import hub_cache_dir, hub_dataset, local_model_dir, resolve, resolve_config  # noqa: E402


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _model_dir(tmp_path: Path, tag: str = "a") -> Path:
    d = tmp_path / f"model-{tag}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "tag": tag}))
    (d / "model.safetensors").write_bytes(b"weights " + tag.encode())
    return d


def test_a_hub_model_resolves_and_pins_the_commit(hub, tmp_path):
    rev = add_model(hub, "acme/tiny", _model_dir(tmp_path))
    snap = resolve("acme/tiny", key="policy.model_name")
    assert snap.commit == rev and snap.path == hub / "models--acme--tiny" / "snapshots" / rev
    assert json.loads((snap.path / "config.json").read_text())["tag"] == "a"  # through the blob symlink
    assert snap.pinned == f"acme/tiny@{rev}"
    # a tag and a commit hash resolve too; the recipe's hub names come pinned from resolve_config
    v1 = add_model(hub, "acme/tiny", _model_dir(tmp_path, "b"), ref="v1")
    assert resolve("acme/tiny", key="k", revision="v1").commit == v1 != rev
    assert resolve("acme/tiny", key="k", revision=rev).path.name == rev
    cfg = config_from_dict({"policy": {"model_name": "acme/tiny", "model_revision": "v1"}})
    assert resolve_config(cfg)["policy.model_name"].commit == v1
    # a worker turns the pinned name back into the same directory (a plain directory stays itself)
    assert local_model_dir(f"acme/tiny@{v1}") == resolve("acme/tiny", key="k", revision="v1").path
    assert local_model_dir(str(tmp_path / "model-a")) == tmp_path / "model-a"


def test_a_missing_name_fails_in_one_line_naming_key_cache_and_switch(hub):
    cfg = config_from_dict({"policy": {"model_name": "acme/absent"}})
    with pytest.raises(ConfigError) as e:
        resolve_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("policy.model_name: hub model acme/absent (revision main)")
    assert f"not in the Hugging Face cache {hub}" in msg and "downloads are off" in msg
    assert "hub.allow_downloads=true" in msg
    add_snapshot(hub, "model", "acme/absent", {"config.json": b"{}"})  # present now, but not at this revision
    with pytest.raises(ConfigError, match=r"^policy.model_name: hub model acme/absent \(revision v9\)"):
        resolve_config(config_from_dict({"policy": {"model_name": "acme/absent", "model_revision": "v9"}}))


def test_data_keys_missing_from_the_cache_name_their_key(hub):
    cfg = config_from_dict({"data": {"train_path": "acme/math", "validation_path": "data/val.jsonl"}})
    with pytest.raises(ConfigError, match=r"^data.train_path: hub dataset acme/math \(revision main\) is not in"):
        resolve_config(cfg)
    add_snapshot(hub, "dataset", "acme/math", {"data/train-00000-of-00001.parquet": b"x"})
    assert list(resolve_config(cfg)) == ["data.train_path"]  # the jsonl path is a file: not resolved


def test_model_revision_needs_a_hub_model():
    with pytest.raises(ConfigError, match=r"^policy.model_revision: 'v1' applies to a hub model id"):
        resolve_config(config_from_dict({"policy": {"model_revision": "v1"}}))


def test_files_and_hub_datasets_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "local").mkdir()
    assert hub_dataset("openai/gsm8k") == ("openai/gsm8k", "main")
    assert hub_dataset("openai/gsm8k@refs-pr-1") == ("openai/gsm8k", "refs-pr-1")
    for path in ("data/train.jsonl", "acme/math.parquet", "x/y.pq", "a/b.json", "s3://bucket/ds", "file:///a/b",
                 "acme/local", "embedded", "a/b/c", "/abs/path"):
        assert hub_dataset(path) is None, path


def test_cache_dir_follows_the_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c1"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "c1"
    monkeypatch.delenv("HF_HUB_CACHE")
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"


def test_run_env_keeps_the_users_hf_cache_and_is_offline_unless_allowed(monkeypatch, tmp_path):
    for key in [*cache_env(tmp_path), "HF_HOME", "HF_HUB_CACHE"]:
        monkeypatch.delenv(key, raising=False)
    apply_env(tmp_path / "run")
    assert "HF_HOME" not in os.environ and "HF_HUB_CACHE" not in os.environ  # the user's cache, not a run-local one
    assert os.environ["HF_DATASETS_CACHE"] == str(tmp_path / "run" / "cache" / "datasets")
    # compile caches: shared by the runs of one folder (vLLM's model inspection runs once, not once per run)
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / ".cache" / "vllm")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "inductor")
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"
    apply_env(tmp_path / "run", allow_downloads=True)  # hub.allow_downloads: the run's processes may download
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "0"
