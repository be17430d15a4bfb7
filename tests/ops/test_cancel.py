"""Cancel and cleanup: SIGTERM to ``python -m flows.grpo`` stops the run within 30 s with every
process it started gone (Ray, its actors and their in-process vLLM engines, the run's temporary Prefect server) and
the last complete checkpoint intact; ``prefect flow-run cancel`` of a deployment run on the local stack ends the same
way, with the flow run CANCELLED. (``kill -9`` of the driver alone, where the run's watchdog ends everything:
tests/ops/test_reliability.py, with the resume that follows.)

Every process of a run inherits a random marker variable from the test, so "gone" is checked over /proc, not
over the process group (Ray and the watchdog leave the driver's group)."""

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
from _ops import PREFECT, ROOT, TINY, kill_marked, processes_with_env, rest, run_logged, wait_for

from storage.checkpoint import MANIFEST, CheckpointStore

MARK = "FP8_GRPO_CANCEL_MARK"
LONG = [*TINY, "grpo.max_num_steps=50"]  # never finishes on its own within the test


def _cmdline(pid: int, limit: int | None = 120) -> str:
    """The process's command line (cut to ``limit`` characters for messages; whole for matching: a long install path
    such as CI's pushes "prefect" in the uvicorn server's command line past any fixed cut)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:limit]
    except OSError:
        return "?"


def _start(tmp_path: Path, mark: str, *extra: str) -> tuple[subprocess.Popen, Path, Path, object]:
    run_dir = tmp_path / "run"
    env = {**os.environ, MARK: mark, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the run's own temporary Prefect server
    log_path = tmp_path / "run.log"
    log = open(log_path, "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "flows.grpo", "configs/tiny_fp8_e2e.yaml", *LONG, f"run_dir={run_dir}",
           f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run_dir, log_path, log


def _gone_within(mark: str, seconds: float) -> tuple[float, list[str]]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not processes_with_env(MARK, mark):
            return time.monotonic() - t0, []
        time.sleep(0.2)
    return time.monotonic() - t0, [f"{p}: {_cmdline(p)}" for p in processes_with_env(MARK, mark)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_stops_the_run_within_30s_with_nothing_left(tmp_path, mode):
    """Asynchronous too: from step 2 on a rollout for the next step is in flight while the step trains."""
    from mlflow.tracking import MlflowClient

    mark = uuid.uuid4().hex
    proc, run_dir, log_path, log = _start(tmp_path, mark, f"grpo.async_grpo.enabled={mode == 'async'}")
    ck = run_dir / "checkpoints"
    try:
        wait_for(lambda: (ck / "step_000001" / MANIFEST).exists() or proc.poll() is not None, 600,
                 "first checkpoint", poll=0.1)
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{log_path.read_text()[-3000:]}"
        before = processes_with_env(MARK, mark)
        kinds = " ".join(_cmdline(p, None) for p in before)
        assert "raylet" in kinds and "prefect" in kinds and "ray::" in kinds, kinds  # what must end
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the driver only, as `kill PID` would
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            rc = None
        exited = time.monotonic() - t0
        waited, left = _gone_within(mark, max(0.0, 30 - exited))
        print(f"\n[SIGTERM: driver exited after {exited:.1f}s (rc {rc}), all {len(before)} processes gone after "
              f"{exited + waited:.1f}s]")
        assert rc is not None, f"driver still running 30 s after SIGTERM:\n{log_path.read_text()[-3000:]}"
        assert not left, f"still running {exited + waited:.1f}s after SIGTERM: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        kill_marked(MARK, mark)
    out = log_path.read_text()
    assert "stopping the workers and Ray" in out, out[-3000:]

    store = CheckpointStore(str(ck))
    last = store.latest_step()
    assert last is not None and last >= 1
    loaded = store.load(last)  # the last complete checkpoint loads (weights, optimizer, state)
    assert loaded.state["step"] == last
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert c.get_run(loaded.state["mlflow_run_id"]).info.status == "KILLED"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_prefect_cancel_of_a_deployment_run(stack, tmp_path):
    from mlflow.tracking import MlflowClient

    mark, name = uuid.uuid4().hex, f"cancel-{uuid.uuid4().hex[:8]}"
    run_dir, db = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {"config_path": "configs/tiny_fp8_e2e.yaml",
              "overrides": [*LONG, f"run_dir={run_dir}", f"logger.mlflow.tracking_uri={db}"]}
    r = run_logged([PREFECT, "deployment", "run", "fp8-grpo/fp8-grpo", "--params", json.dumps(params),
                    "--flow-run-name", name, "--job-variable", "env=" + json.dumps({MARK: mark})],
                   env=stack["env"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    api = stack["prefect_api_url"]

    def flow_run() -> dict:
        runs = rest(f"{api}/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
        assert len(runs) == 1, runs
        return runs[0]

    ck = run_dir / "checkpoints"
    try:
        wait_for(lambda: (ck / "step_000001" / MANIFEST).exists() or flow_run()["state_type"] in
                 ("FAILED", "CRASHED", "COMPLETED", "CANCELLED"), 900, "first checkpoint", poll=0.5)
        assert flow_run()["state_type"] == "RUNNING", flow_run()["state"]
        before = processes_with_env(MARK, mark)
        kinds = " ".join(_cmdline(p, None) for p in before)
        assert "raylet" in kinds and "ray::" in kinds, kinds
        t0 = time.monotonic()
        c = run_logged([PREFECT, "flow-run", "cancel", flow_run()["id"]], env=stack["env"], timeout=60)
        assert c.returncode == 0, c.stdout + c.stderr
        waited, left = _gone_within(mark, 30 - (time.monotonic() - t0))
        gone = time.monotonic() - t0
        state = wait_for(lambda: flow_run()["state_type"] in ("CANCELLED", "FAILED", "CRASHED", "COMPLETED")
                         and flow_run()["state_type"], 60, "a final flow-run state")
        print(f"\n[prefect flow-run cancel: all {len(before)} processes of the run gone after {gone:.1f}s; "
              f"flow run {state} after {time.monotonic() - t0:.1f}s]")
        assert not left, f"still running {gone:.1f}s after the cancel: {left}"
        assert state == "CANCELLED"
    finally:
        kill_marked(MARK, mark)
    store = CheckpointStore(str(ck))
    last = store.latest_step()
    loaded = store.load(last)
    assert last >= 1 and loaded.state["step"] == last
    assert MlflowClient(tracking_uri=db).get_run(loaded.state["mlflow_run_id"]).info.status == "KILLED"
