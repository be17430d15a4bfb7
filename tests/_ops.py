"""Helpers of the operations end-to-end tests (tests/ops, tests/scripts): loaded with ``sys.path`` as tests/_hub.py is."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "scripts" / "stack"
PREFECT = str(Path(sys.executable).with_name("prefect"))
ASSETS = ROOT / "runs" / "test-env" / "ops-assets"  # tiny model + data, bootstrapped once (short SFT) and cached
BUCKET = "fp8-grpo-ops"

# 2 RL steps on 2 prompts x 2 generations, 4 validation prompts of the main set only (no extra sets, no sampled
# pass@k: tests/flows cover those), short answers: the smallest real run.
TINY = ["grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4", "grpo.max_val_samples=4",
        "grpo.val_period=0", "grpo.val_at_start=false", "policy.generation.max_new_tokens=16", "checkpointing.save_period=1",
        "evaluation.sets=[]", "evaluation.num_samples=0", f"bootstrap.assets_dir={ASSETS}", "bootstrap.sft_steps=30"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status < 500
    except OSError:
        return False


def wait_for(cond, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cond()
        if out:
            return out
        time.sleep(poll)
    raise TimeoutError(f"{what} not reached after {timeout:.0f}s")


def proc_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def processes_with_env(key: str, value: str) -> list[int]:
    """PIDs (not zombies) whose environment has key=value: everything a stack or a flow run started inherits it."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            except OSError:
                continue
            if proc_env(int(p.name)).get(key) == value:
                out.append(int(p.name))
    return out


def kill_marked(key: str, value: str) -> list[int]:
    pids = processes_with_env(key, value)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def s3_client(url: str):
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1")


class FaultyS3Proxy:
    """HTTP proxy in front of moto that answers ``503 SlowDown`` to the first ``fail_first`` PUTs of every object key
    matching one of ``patterns`` (``fail_first=None``: always) — transient storage errors on a real S3 wire."""

    def __init__(self, upstream: str, patterns: tuple[str, ...], fail_first: int | None):
        self.upstream = upstream.split("://", 1)[1]
        self.patterns, self.fail_first = patterns, fail_first
        self.seen: dict[str, int] = {}
        self.injected: list[str] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?", 1)[0]
                if self.command == "PUT" and any(p in path for p in proxy.patterns):
                    with proxy.lock:
                        n = proxy.seen[path] = proxy.seen.get(path, 0) + 1
                        fail = proxy.fail_first is None or n <= proxy.fail_first
                        if fail:
                            proxy.injected.append(path)
                    if fail:
                        msg = b"<Error><Code>SlowDown</Code><Message>injected by test</Message></Error>"
                        self.send_response(503)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(msg)))
                        self.end_headers()
                        self.wfile.write(msg)
                        return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # HEAD: keep the object's length (s3fs takes the size from it); else the body we forward
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def stack_cmd(run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(STACK), *args, "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def run_logged(cmd: list[str], *, env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    print(f"\n[{' '.join(cmd[:4])} ... rc={r.returncode} {time.monotonic() - t0:.1f}s]\n{r.stdout[-4000:]}\n"
          f"{r.stderr[-4000:]}")
    return r


def rest(url: str, body: dict | None = None, method: str | None = None) -> dict | list:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())

