"""Fixtures of the operations e2e tests: a moto S3 server (subprocess on 127.0.0.1, free port), a fault-injecting
S3 proxy in front of it, the local stack (scripts/stack, session-scoped so the deployment, regression and resume
tests share one Prefect + MLflow server), and the tiny 2-step overrides.

S3 credentials are random per session and exported to the environment (so the stack's worker and its flow runs
inherit them); tests search MLflow and Prefect for them afterwards."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests import the helpers (tests/_ops.py): from _ops import ...

from _ops import (  # noqa: E402
    BUCKET,
    FaultyS3Proxy,
    free_port,
    http_ok,
    kill_marked,
    proc_env,
    processes_with_env,
    s3_client,
    stack_cmd,
    wait_for,
)


# ------------------------------------------------------------------------------------------------------ S3
@pytest.fixture(scope="session")
def s3_credentials():
    creds = {"AWS_ACCESS_KEY_ID": "AKIAOPS" + secrets.token_hex(6).upper(),
             "AWS_SECRET_ACCESS_KEY": "opsSecret" + secrets.token_hex(12), "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    yield creds
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto(s3_credentials, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(url + "/moto-api/"), 60, "moto_server")
        s3 = s3_client(url)
        s3.create_bucket(Bucket=BUCKET)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def faulty_s3(moto):
    proxies = []

    def make(patterns=("manifest.json", "model.safetensors"), fail_first: int | None = 1) -> FaultyS3Proxy:
        p = FaultyS3Proxy(moto, patterns, fail_first)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()


# ------------------------------------------------------------------------------------------------------ stack
@pytest.fixture(scope="session")
def stack(moto, tmp_path_factory):
    """The local stack (Prefect server + pool + worker + deployments + MLflow server) on free loopback ports.
    Teardown: ``scripts/stack stop`` must succeed and leave no process of the stack (or of its flow runs) alive."""
    run_dir = tmp_path_factory.mktemp("stack")
    t0 = time.monotonic()
    r = stack_cmd(run_dir, "start", "--prefect-port", "0", "--mlflow-port", "0", timeout=400)
    print(f"\n[stack start {time.monotonic() - t0:.1f}s]\n{r.stdout}{r.stderr}")
    if r.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (run_dir / "logs").glob("*.log"))
        stack_cmd(run_dir, "stop")
        pytest.fail(f"scripts/stack start failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n{logs}")
    state = json.loads((run_dir / "stack.json").read_text())
    env = dict(os.environ)
    for line in stack_cmd(run_dir, "env").stdout.splitlines():
        key, value = line[len("export "):].split("=", 1)
        if key != "PATH":
            env[key] = value.strip("'")
    state["env"] = env
    state["run_dir"] = run_dir
    try:
        yield state
    finally:
        pids = {name: (run_dir / "pids" / f"{name}.pid").read_text().split()[0]
                for name in ("mlflow", "prefect-server", "worker") if (run_dir / "pids" / f"{name}.pid").exists()}
        t0 = time.monotonic()
        r = stack_cmd(run_dir, "stop")
        print(f"\n[stack stop {time.monotonic() - t0:.1f}s]\n{r.stdout}{r.stderr}")
        home = str(run_dir / "prefect")
        left = processes_with_env("PREFECT_HOME", home)
        kill_marked("PREFECT_HOME", home)  # never leave them behind, even when the assertion below fails
        assert r.returncode == 0, r.stdout + r.stderr
        alive = [p for p in pids.values() if proc_env(int(p)).get("PREFECT_HOME") == home]
        assert not alive, f"recorded stack processes still alive: {alive} of {pids}"
        assert not left, f"processes of the stack still running after stop: {left}"
        status = stack_cmd(run_dir, "status")
        assert status.returncode == 3 and "running" not in status.stdout.replace("not running", ""), status.stdout


