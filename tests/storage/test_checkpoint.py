"""Checkpoints: manifest written last, incomplete ones ignored/refused, retries, pruning, local and moto S3."""
import json

import pytest
import torch

from storage.checkpoint import CheckpointError, CheckpointStore, rng_state, set_rng_state


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            "lm_head.weight": torch.randn(3, 4, generator=g)}


def _save(store, step, seed=0):
    opt = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}
    return store.save(step, weights=_weights(seed), model_files={"config.json": b'{"a": 1}'}, optimizer=opt,
                      rng=rng_state(), state={"mlflow_run_id": "abc", "clip_bounds": [0.2, 0.28],
                                              "kv_scales": {"0": [0.1, 0.2]}})


def test_roundtrip_and_latest(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/ck")
    assert store.latest_step() is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.load()
    uri = _save(store, 2)
    _save(store, 10, seed=1)
    assert uri.endswith("step_000002") and store.latest_step() == 10
    ck = store.load()
    assert ck.step == 10 and ck.state["mlflow_run_id"] == "abc" and ck.state["clip_bounds"] == [0.2, 0.28]
    for k, v in _weights(1).items():
        assert torch.equal(ck.weights[k], v) and ck.weights[k].dtype == v.dtype
    assert ck.optimizer["param_groups"][0]["lr"] == 0.1
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    files = sorted(p.name for p in (tmp_path / "ck" / "step_000010").iterdir())
    assert files == ["config.json", "manifest.json", "model.safetensors", "optimizer.pt", "rng.pt",
                     "trainer_state.json"]
    out = store.download_model(10, tmp_path / "hf")
    assert (out / "config.json").read_bytes() == b'{"a": 1}' and (out / "model.safetensors").exists()


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    _save(store, 1)
    _save(store, 2)
    (tmp_path / "ck" / "step_000002" / "manifest.json").unlink()  # killed before the manifest
    assert store.latest_step() == 1
    with pytest.raises(CheckpointError, match="no manifest.json"):
        store.load(2)
    _save(store, 3)
    (tmp_path / "ck" / "step_000003" / "optimizer.pt").write_bytes(b"truncated")  # size differs from manifest
    assert store.latest_step() == 1
    with pytest.raises(CheckpointError, match="does not match"):
        store.load(3)
    (tmp_path / "ck" / "step_000004").mkdir()  # empty dir
    assert store.complete_steps() == [1]


def test_prune_keeps_newest(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    for s in (1, 2, 3, 4):
        _save(store, s)
    assert store.prune(2) == [1, 2]
    assert store.complete_steps() == [3, 4] and not (tmp_path / "ck" / "step_000001").exists()


def test_transient_write_errors_are_retried(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ck"))
    real_open, calls = store.fs.open, {"n": 0}

    def flaky(path, mode="rb", **kw):
        if "w" in mode and path.endswith("optimizer.pt") and calls["n"] < 2:
            calls["n"] += 1
            raise ConnectionResetError("transient")
        return real_open(path, mode, **kw)

    monkeypatch.setattr(store.fs, "open", flaky)
    monkeypatch.setattr("storage.checkpoint.time.sleep", lambda s: None)
    _save(store, 5)
    assert calls["n"] == 2 and store.latest_step() == 5

    def broken(path, mode="rb", **kw):
        if "w" in mode and path.endswith("rng.pt"):
            raise ConnectionResetError("down")
        return real_open(path, mode, **kw)

    monkeypatch.setattr(store.fs, "open", broken)
    with pytest.raises(CheckpointError, match="rng.pt: failed after 4 attempts"):
        _save(store, 6)
    monkeypatch.setattr(store.fs, "open", real_open)
    assert store.latest_step() == 5  # the failed save left no manifest
    # Re-saving an existing step first invalidates it: a crash mid-overwrite cannot leave old manifest + new files.
    monkeypatch.setattr(store.fs, "open", broken)
    with pytest.raises(CheckpointError):
        _save(store, 5)
    monkeypatch.setattr(store.fs, "open", real_open)
    assert store.latest_step() is None




@pytest.mark.e2e
def test_s3_roundtrip_with_moto(moto_s3):
    store = CheckpointStore("s3://ckpts/run1", endpoint_url=moto_s3)
    store.fs.mkdir("ckpts")
    uri = _save(store, 7)
    assert uri == "s3://ckpts/run1/step_000007"
    store.fs.pipe("ckpts/run1/step_000008/model.safetensors", b"partial")  # a save that died early
    fresh = CheckpointStore("s3://ckpts/run1")  # endpoint from the environment
    assert fresh.latest_step() == 7
    ck = fresh.load()
    assert ck.step == 7 and torch.equal(ck.weights["lm_head.weight"], _weights()["lm_head.weight"])
    assert json.loads(fresh.fs.cat("ckpts/run1/step_000007/manifest.json"))["step"] == 7
