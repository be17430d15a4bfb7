"""Reliability: after ``kill -9`` of the driver alone (its first checkpoint written), the run's watchdog
(process/watchdog.py) ends everything the driver had started (Ray, its actors and their vLLM engines, the run's
temporary Prefect server) within 30 s, and the run resumes at the next step in the same MLflow run with a continuous
step counter, ignoring checkpoints without a manifest; storage errors while writing a checkpoint
are retried and a write that keeps failing leaves nothing resume would load; bad input fails with a clear error
naming the problem before any worker starts.

Schema-level rejections (unknown key, wrong type, impossible combination) are unit-tested in
tests/configs/test_schema.py and loader errors in tests/data/test_data.py; here the same inputs go through the
real entry points (CLI / flow) to check they stop before Ray and the workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _ops import BUCKET, ROOT, TINY, kill_marked, processes_with_env, run_logged, s3_client, wait_for
from _runs import check_refits_and_mismatch

from storage.checkpoint import MANIFEST, CheckpointError, CheckpointStore

MARK = "FP8_GRPO_OPS_MARK"


def _env(stack: dict | None, mark: str) -> dict:
    env = dict(stack["env"]) if stack else dict(os.environ)
    env[MARK] = mark
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_of_the_driver_leaves_nothing_running_then_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir, mark = tmp_path / "run", uuid.uuid4().hex
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = ["configs/tiny_fp8_e2e.yaml", *TINY, f"run_dir={run_dir}",
            f"logger.mlflow.tracking_uri={uri}", "checkpointing.keep_last_k=5"]
    env = _env(None, mark)
    env.pop("PREFECT_API_URL", None)  # the run's own temporary Prefect server: the watchdog must end it too
    ck = run_dir / "checkpoints"
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "flows.grpo", *base], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (ck / "step_000001" / MANIFEST).exists() or proc.poll() is not None, 900,
                 "first checkpoint", poll=0.05)
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{(tmp_path / 'first.log').read_text()}"
        before = processes_with_env(MARK, mark)
        kinds = " ".join(_cmdline(p) for p in before)
        assert "raylet" in kinds and "prefect" in kinds and "ray::" in kinds, kinds  # what must end
        os.kill(proc.pid, signal.SIGKILL)  # the crash: the driver alone, its children orphaned
        proc.wait(10)
        t_kill = time.monotonic()
        while (left := processes_with_env(MARK, mark)) and time.monotonic() - t_kill < 30:
            time.sleep(0.2)
        print(f"[kill -9 of the driver after its first checkpoint at {t_kill - t0:.1f}s: all {len(before)} "
              f"processes gone after {time.monotonic() - t_kill:.1f}s]")
        assert not left, f"still running 30 s after kill -9 of the driver: {[_cmdline(p)[:120] for p in left]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        kill_marked(MARK, mark)

    store = CheckpointStore(str(ck))
    done = store.latest_step()
    assert done == 1, f"killed too late: checkpoint {done} already complete"
    state = store.load_state(done)
    run_id = state["mlflow_run_id"]
    # A crash mid-save leaves files without a manifest: plant one at the next step and one far ahead; both ignored.
    for bogus in (done + 1, 9):
        d = ck / f"step_{bogus:06d}"
        d.mkdir(exist_ok=True)
        (d / MANIFEST).unlink(missing_ok=True)
        (d / "model.safetensors").write_bytes(b"partial")
        (d / "trainer_state.json").write_text(json.dumps({"step": bogus, "mlflow_run_id": "bogus"}))
    assert store.latest_step() == done

    r = run_logged([sys.executable, "-m", "flows.grpo", *base, "checkpointing.resume=true"], env=env, timeout=900)
    kill_marked(MARK, mark)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resume: checkpoint {store.step_uri(done)} (step {done})" in r.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"], summary["mlflow_run_id"]) == (done + 1, 2, run_id)

    c = MlflowClient(tracking_uri=uri)
    runs = c.search_runs([c.get_experiment_by_name("fp8-grpo").experiment_id])
    assert [x.info.run_id for x in runs] == [run_id], "resume must continue the same MLflow run"
    assert runs[0].info.status == "FINISHED"
    for key in ("reward/mean", "time/step_s", "mismatch/token_mult_prob_error"):
        steps = sorted(m.step for m in c.get_metric_history(run_id, key))
        assert steps == [1, 2], (key, steps)  # each step once, also one the killed run had logged
    assert store.latest_step() == 2 and store.is_complete(done + 1)  # the partial dir was rewritten completely
    assert store.load(done + 1).state["mlflow_run_id"] == run_id
    check_refits_and_mismatch(c, run_id)  # the resumed step ran on the refit of the checkpoint's policy


@pytest.mark.e2e
@pytest.mark.slow
def test_storage_errors_retried_and_never_resumable_when_persistent(moto, faulty_s3):
    """Through an S3 proxy that answers 503: a few transient failures of the manifest and weights are retried until
    the checkpoint is complete; a manifest write that keeps failing raises, and that step is never considered for
    resume (files without manifest), while the previous checkpoint stays the latest."""
    import torch

    tag = uuid.uuid4().hex[:8]
    weights = {"model.layers.0.w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}

    transient = faulty_s3(patterns=("manifest.json", "model.safetensors"), fail_first=2)
    store = CheckpointStore(f"s3://{BUCKET}/transient-{tag}", endpoint_url=transient.url)
    store.save(1, weights=weights, state={"mlflow_run_id": "r1"})
    assert len(transient.injected) == 4  # 2 x manifest + 2 x weights
    assert store.is_complete(1) and torch.equal(store.load(1).weights["model.layers.0.w"], weights["model.layers.0.w"])

    # With the default options (botocore 5 attempts x s3fs 5 retries x CheckpointStore 4 attempts = 100 requests)
    # a persistent failure takes ~3 min to surface; one attempt per layer below CheckpointStore keeps this test short.
    persistent = faulty_s3(patterns=("step_000002/manifest.json",), fail_first=None)
    store = CheckpointStore(f"s3://{BUCKET}/persistent-{tag}", storage_options={
        "client_kwargs": {"endpoint_url": persistent.url}, "config_kwargs": {"retries": {"max_attempts": 1}}})
    store.fs.retries = 1  # s3fs's own retry loop (a class attribute; this instance is unique to the proxy URL)
    store.save(1, weights=weights, state={"mlflow_run_id": "r1"})
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="manifest.json"):
        store.save(2, weights={k: v + 1 for k, v in weights.items()}, state={"mlflow_run_id": "r1"})
    print(f"[persistent failure gave up after {time.monotonic() - t0:.1f}s, {len(persistent.injected)} attempts]")
    assert len(persistent.injected) >= 2
    keys = {o["Key"] for o in s3_client(moto).list_objects_v2(Bucket=BUCKET, Prefix=f"persistent-{tag}/step_000002")
            ["Contents"]}
    assert f"persistent-{tag}/step_000002/model.safetensors" in keys  # the partial files are there ...
    assert store.latest_step() == 1  # ... but resume never sees them
    with pytest.raises(CheckpointError, match="incomplete|manifest"):
        store.load(2)


@pytest.mark.slow
@pytest.mark.parametrize("override, needle", [
    ("grpo.max_num_stepz=2", "grpo.max_num_stepz: unknown key"),
    ("grpo.max_num_steps=two", "grpo.max_num_steps: expected an integer"),
    ("policy.generation.vllm_cfg.kv_cache_dtype=fp8 calibration.kv_scales_period=0", "calibration.kv_scales_period"),
])
def test_cli_rejects_bad_config_before_starting_anything(override, needle, tmp_path):
    """Unknown key, wrong type, impossible combination (FP8 KV cache that would never get calibrated scales): the CLI
    exits 2 with the dotted path, before Prefect, Ray or any worker starts."""
    r = subprocess.run([sys.executable, "-m", "flows.grpo", "configs/tiny_fp8_e2e.yaml", *override.split(),
                        f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr
    assert "workers up" not in r.stdout and not (tmp_path / "run").exists()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing_file", "no_answer_column"])
def test_flow_rejects_bad_dataset_before_workers(case, stack, tmp_path):
    """A missing dataset file / a dataset without the answer column fails the flow with the path / column named,
    before Ray and the workers start (no 'workers up' line, no actor processes)."""
    mark = uuid.uuid4().hex
    if case == "missing_file":
        train, needle = tmp_path / "nope" / "train.jsonl", "nope/train.jsonl"
        val = train
    else:
        train = tmp_path / "train.jsonl"
        train.write_text("".join(json.dumps({"question": f"{i}+1?", "solution": str(i + 1)}) + "\n" for i in range(8)))
        val, needle = train, "answer"
    r = run_logged([sys.executable, "-m", "flows.grpo", "configs/tiny_fp8_e2e.yaml", *TINY, f"run_dir={tmp_path / 'r'}",
                    f"data.train_path={train}", f"data.validation_path={val}", "logger.mlflow_enabled=false"],
                   env=_env(stack, mark), timeout=300)
    workers = [p for p in processes_with_env(MARK, mark)
               if "ray::" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    kill_marked(MARK, mark)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert needle in out, out[-3000:]
    assert "workers up" not in out and not workers


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("case", ["malformed_line", "missing_key"])
def test_cli_prints_one_line_for_a_bad_data_file(case, tmp_path):
    """A data file with one malformed JSON line / one line without the answer key: ``python -m flows.grpo`` (its own
    temporary Prefect server, no stack) exits 2 with exactly one line on stderr -- ``data error: <file>:<line>: <what
    is wrong>``, no traceback -- before the flow starts (nothing on stdout, where the flow's recipe line would come
    first; Prefect's temporary server is not started), and neither Ray nor a worker process appears while it runs."""
    mark = uuid.uuid4().hex
    lines = [json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) for i in range(8)]
    if case == "malformed_line":
        lines[4] = lines[4][:-1]  # the closing brace lost on line 5
        what = ":5: not valid JSON: Expecting ',' delimiter (column 35)"
    else:
        lines[2] = json.dumps({"question": "2+1?", "solution": "3"})
        what = ":3: no answer key 'answer' (set data.answer_key); keys on this line: ['question', 'solution']"
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "flows.grpo", "configs/tiny_fp8_e2e.yaml", *TINY, f"run_dir={tmp_path / 'r'}",
           f"data.train_path={train}", f"data.validation_path={train}", "logger.mlflow_enabled=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(None, mark), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen: set[str] = set()  # command lines of Ray's processes (raylet, gcs_server, ray:: workers) while it runs
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        for p in processes_with_env(MARK, mark):
            try:
                cmdline = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            except OSError:
                continue
            if "ray::" in cmdline or "raylet" in cmdline or "gcs_server" in cmdline:
                seen.add(cmdline[:200])
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    kill_marked(MARK, mark)
    assert proc.returncode == 2, out[-3000:] + err[-3000:]
    assert err.splitlines() == [f"data error: {train}{what}"], err[-3000:]
    assert out == "" and not seen, (out[-3000:], seen)
