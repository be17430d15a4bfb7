"""The local fp8-grpo stack on loopback: a Prefect server, the process work pool, a process worker, the project's
deployments (``prefect --no-prompt deploy --all``) and an MLflow tracking server with its UI.

    scripts/stack start  [--run-dir runs/stack] [--prefect-port 4200] [--mlflow-port 5000]   (port 0 = a free one)
    scripts/stack status [--run-dir ...] [--json]
    scripts/stack env    [--run-dir ...]     # `eval "$(scripts/stack env)"`: point prefect/mlflow CLIs at the stack
    scripts/stack stop   [--run-dir ...] [--timeout 30]

Everything lives under the run dir: ``stack.json`` (ports, URLs), ``pids/<service>.pid`` ("PID START_TIME", each
service started in its own session so PID = process group id), ``logs/<service>.log``, the Prefect home and
database, the MLflow store (``mlflow.db`` + ``mlartifacts/``) and the caches of flow runs (vLLM, inductor, HF) unless
the environment already sets them. ``stop`` ends exactly the recorded processes (checked against their start time,
so a reused PID is never signalled) and their descendants: SIGTERM to the process group, a second SIGTERM for the
worker (Prefect's worker ignores the first one), then SIGKILL after ``--timeout``.

Ray: each flow run starts its own local Ray with token authentication, using the stack's token file
``<run dir>/ray_auth_token`` (random, mode 0600, replaced at every ``start``, never printed); Ray's ports listen on
the node's address, not loopback, so the token is what keeps other machines out.

Flow runs started by the worker inherit the worker's environment: ``MLFLOW_TRACKING_URI`` = the stack's MLflow
server, plus whatever the caller exported (e.g. AWS_* credentials for s3:// checkpoints; they are never written to
MLflow because tasks/tracking.py logs the resolved config only, and recipes hold no credentials).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import process.quiet  # noqa: E402,F401  third-party start-up noise off
from cluster.auth import TOKEN_FILE, write_token_file  # noqa: E402

POOL = "fp8-grpo-process"
WORKER_NAME = "fp8-grpo-stack-worker"
DEFAULT_RUN_DIR = ROOT / "runs" / "stack"
SERVICES = ("mlflow", "prefect-server", "worker")  # start order; stop goes in reverse


# ------------------------------------------------------------------------------------------------------ processes
def _start_time(pid: int) -> str | None:
    """Process start time (clock ticks since boot, /proc/PID/stat field 22): identifies a process beyond its PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # zombie: already dead
        return None
    return fields[19]


def _alive(pid: int, start: str | None) -> bool:
    return start is not None and _start_time(pid) == start


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(p.name))
    return out


def descendants(pid: int) -> list[int]:
    kids, todo, out = _children_map(), [pid], []
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _read_pid(run_dir: Path, name: str) -> tuple[int, str] | None:
    f = run_dir / "pids" / f"{name}.pid"
    try:
        pid, start = f.read_text().split()
        return int(pid), start
    except (OSError, ValueError):
        return None


def _spawn(name: str, cmd: list[str], env: dict, run_dir: Path) -> int:
    log = open(run_dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
    log.flush()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    log.close()
    start = None
    for _ in range(50):  # /proc entry appears at once; loop only guards against a slow fork
        start = _start_time(proc.pid)
        if start:
            break
        time.sleep(0.01)
    (run_dir / "pids" / f"{name}.pid").write_text(f"{proc.pid} {start}\n")
    return proc.pid


def _signal_tree(pid: int, pids: list[int], sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in pids:  # descendants that left the process group (new sessions)
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_service(run_dir: Path, name: str, timeout: float) -> str:
    rec = _read_pid(run_dir, name)
    pid_file = run_dir / "pids" / f"{name}.pid"
    if rec is None:
        return "not started"
    pid, start = rec
    if not _alive(pid, start):
        pid_file.unlink(missing_ok=True)
        return f"pid {pid} already gone"
    tree = descendants(pid)
    starts = {p: _start_time(p) for p in tree}
    _signal_tree(pid, tree, signal.SIGTERM)
    if name == "worker":  # prefect's worker ignores the first SIGTERM
        time.sleep(1.0)
        _signal_tree(pid, [p for p in tree if _alive(p, starts[p])], signal.SIGTERM)
    deadline = time.monotonic() + timeout

    def left() -> list[int]:
        rest = [p for p in tree if _alive(p, starts[p])]
        return ([pid] if _alive(pid, start) else []) + rest

    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    how = "SIGTERM"
    if left():
        how = "SIGKILL"
        _signal_tree(pid, left(), signal.SIGKILL)
        end = time.monotonic() + 10
        while left() and time.monotonic() < end:
            time.sleep(0.1)
    if left():
        return f"pid {pid}: STILL RUNNING {left()}"
    pid_file.unlink(missing_ok=True)
    return f"pid {pid} stopped ({how}, {len(tree)} descendant(s))"


# ------------------------------------------------------------------------------------------------------ environment
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def stack_env(run_dir: Path, state: dict) -> dict[str, str]:
    """Environment of every stack process (and so of every flow run the worker starts)."""
    env = dict(os.environ)
    home = run_dir / "prefect"
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(home / "memo_store.toml"),
        "PREFECT_API_URL": state["prefect_api_url"],
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(state["prefect_port"]),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "MLFLOW_TRACKING_URI": state["mlflow_url"],
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        # every Ray a flow run starts uses token auth with the stack's token file (0600, created by `start`)
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(run_dir / TOKEN_FILE),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
    })
    # The stack's MLflow serves tracking and artifacts; its job runner (GenAI jobs, which the pipeline never submits)
    # would start a dozen huey consumer processes of ~4 s CPU each and keep them polling. MLFLOW_SERVER_ENABLE_JOB_
    # EXECUTION=true in the caller's environment turns it back on.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    cache = run_dir / "cache"
    for key, path in (("VLLM_CACHE_ROOT", cache / "vllm"), ("TORCHINDUCTOR_CACHE_DIR", cache / "inductor"),
                      ("HF_HOME", cache / "hf")):
        env.setdefault(key, str(path))
    env.pop("PREFECT_PROFILES_PATH", None)
    env.pop("RAY_AUTH_TOKEN", None)  # the token file is the one source
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


def _post_json(url: str, body: dict, timeout: float = 5.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class ServiceExited(SystemExit):
    """A service died while starting (e.g. its port was taken between choosing and binding it)."""


def _wait(what: str, check, timeout: float, run_dir: Path, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        rec = _read_pid(run_dir, name)
        if rec and not _alive(*rec):
            raise ServiceExited(f"stack: {what} exited during start; see {run_dir / 'logs' / (name + '.log')}")
        time.sleep(0.5)
    raise SystemExit(f"stack: {what} not ready after {timeout:.0f}s; see {run_dir / 'logs' / (name + '.log')}")


def _worker_online(state: dict) -> bool:
    try:
        workers = _post_json(f"{state['prefect_api_url']}/work_pools/{POOL}/workers/filter", {})
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return any(w.get("name") == WORKER_NAME and w.get("status") == "ONLINE" for w in workers)


def _run(cmd: list[str], env: dict, run_dir: Path, name: str, timeout: float = 300) -> None:
    with open(run_dir / "logs" / f"{name}.log", "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"stack: `{' '.join(cmd)}` failed (exit {r.returncode}); see {run_dir / 'logs' / name}.log")


# ------------------------------------------------------------------------------------------------------ commands
def _state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def service_status(run_dir: Path) -> dict[str, dict]:
    state = _state(run_dir) or {}
    health = {"mlflow": f"{state.get('mlflow_url')}/health", "prefect-server": f"{state.get('prefect_api_url')}/health"}
    out = {}
    for name in SERVICES:
        rec = _read_pid(run_dir, name)
        alive = bool(rec) and _alive(*rec)
        info = {"pid": rec[0] if rec else None, "running": alive}
        if alive and name in health and state:
            info["healthy"] = _http_ok(health[name])
        if alive and name == "worker" and state:
            info["healthy"] = _worker_online(state)
        out[name] = info
    return out


def _choose_ports(args, run_dir: Path, store: str) -> dict:
    ports = {}
    for key, port in (("prefect_port", args.prefect_port), ("mlflow_port", args.mlflow_port)):
        if port == 0:
            port = free_port()
        elif not _port_free(port):
            raise SystemExit(f"stack: --{key.replace('_', '-')} {port} is in use on 127.0.0.1; pick another "
                             f"(0 = any free port)")
        ports[key] = port
    state = {"run_dir": str(run_dir), **ports,
             "prefect_api_url": f"http://127.0.0.1:{ports['prefect_port']}/api",
             "prefect_ui_url": f"http://127.0.0.1:{ports['prefect_port']}",
             "mlflow_url": f"http://127.0.0.1:{ports['mlflow_port']}", "mlflow_backend_store_uri": store,
             "work_pool": POOL, "started": time.time()}
    (run_dir / "stack.json").write_text(json.dumps(state, indent=1))
    return state


def _bind_failed(run_dir: Path) -> bool:
    for name in ("mlflow", "prefect-server"):
        try:
            tail = (run_dir / "logs" / f"{name}.log").read_text(errors="replace")[-4000:].lower()
        except OSError:
            continue
        if "address already in use" in tail or "port is already in use" in tail or "errno 98" in tail:
            return True
    return False


def cmd_start(args) -> int:
    run_dir = args.run_dir
    st = service_status(run_dir)
    if any(s["running"] for s in st.values()):
        if all(s["running"] for s in st.values()):
            print(f"stack: already running (run dir {run_dir})")
            return cmd_status(args)
        raise SystemExit(f"stack: partly running in {run_dir}: {st}; run `scripts/stack stop` first")
    for sub in ("pids", "logs", "prefect", "cache"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    write_token_file(run_dir)  # a fresh Ray token for the flow runs of this stack (mode 0600, never printed)
    store = args.backend_store_uri or f"sqlite:///{run_dir / 'mlflow.db'}"
    py = sys.executable
    t0 = time.monotonic()
    try:
        for attempt in range(3):  # auto ports (0) can be taken by another process before the server binds them
            state = _choose_ports(args, run_dir, store)
            env = stack_env(run_dir, state)
            _spawn("mlflow", [py, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                              str(state["mlflow_port"]), "--workers", "1", "--backend-store-uri", store,
                              "--artifacts-destination", str(run_dir / "mlartifacts"), "--serve-artifacts"],
                   env, run_dir)
            _spawn("prefect-server", [py, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(state["prefect_port"])], env, run_dir)
            try:
                _wait("Prefect server", lambda st=state: _http_ok(f"{st['prefect_api_url']}/health"), args.timeout,
                      run_dir, "prefect-server")
                _wait("MLflow server", lambda st=state: _http_ok(f"{st['mlflow_url']}/health"), args.timeout,
                      run_dir, "mlflow")
                break
            except ServiceExited:
                auto = args.prefect_port == 0 or args.mlflow_port == 0
                if attempt == 2 or not auto or not _bind_failed(run_dir):
                    raise
                print("stack: a port was taken while starting; retrying with other free ports", flush=True)
                for name in ("prefect-server", "mlflow"):
                    stop_service(run_dir, name, 15)
        print(f"stack: Prefect server and MLflow server up ({time.monotonic() - t0:.0f}s)", flush=True)
        _run([py, "-m", "prefect", "--no-prompt", "work-pool", "create", POOL, "--type", "process", "--overwrite"],
             env, run_dir, "deploy")
        _spawn("worker", [py, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process",
                          "--name", WORKER_NAME, "--limit", str(args.limit)], env, run_dir)
        _run([py, "-m", "prefect", "--no-prompt", "deploy", "--all"], env, run_dir, "deploy")
        print(f"stack: work pool {POOL} + deployments created ({time.monotonic() - t0:.0f}s)", flush=True)
        _wait("Prefect worker", lambda: _worker_online(state), args.timeout, run_dir, "worker")
    except BaseException:
        print("stack: start failed; stopping what was started", file=sys.stderr)
        for name in reversed(SERVICES):
            stop_service(run_dir, name, 15)
        raise
    where = "" if run_dir == DEFAULT_RUN_DIR.resolve() else f" --run-dir {run_dir}"
    print(f"stack: up in {time.monotonic() - t0:.0f}s (run dir {run_dir})\n"
          f"  Prefect UI  {state['prefect_ui_url']}\n  MLflow UI   {state['mlflow_url']}  (store {store})\n"
          f"  then:  eval \"$(scripts/stack env{where})\"  &&  prefect deployment run fp8-grpo/fp8-grpo\n"
          f"  stop:  scripts/stack stop{where}", flush=True)
    return 0


def cmd_status(args) -> int:
    run_dir = args.run_dir
    st = service_status(run_dir)
    state = _state(run_dir) or {}
    if args.json:
        print(json.dumps({"run_dir": str(run_dir), "services": st, **state}, indent=1))
    else:
        urls = {"mlflow": state.get("mlflow_url"), "prefect-server": state.get("prefect_ui_url"),
                "worker": f"pool {POOL}"}
        for name, s in st.items():
            what = "running" if s["running"] else "stopped"
            if s["running"] and "healthy" in s:
                what += ", healthy" if s["healthy"] else ", NOT healthy"
            print(f"{name:15s} {what:22s} pid {s['pid'] or '-':<8} {urls[name] or ''}")
    n = sum(s["running"] for s in st.values())
    return 0 if n == len(st) else (3 if n == 0 else 1)


def cmd_env(args) -> int:
    state = _state(args.run_dir)
    if not state:
        raise SystemExit(f"stack: no stack.json under {args.run_dir}; run `scripts/stack start` first")
    home = args.run_dir / "prefect"
    for key, value in (("PREFECT_API_URL", state["prefect_api_url"]), ("PREFECT_HOME", str(home)),
                       ("PREFECT_SERVER_MEMO_STORE_PATH", str(home / "memo_store.toml")),
                       ("MLFLOW_TRACKING_URI", state["mlflow_url"]), ("MLFLOW_DISABLE_TELEMETRY", "true")):
        print(f"export {key}='{value}'")
    print(f"export PATH='{Path(sys.executable).parent}':\"$PATH\"")  # the venv's prefect / mlflow CLIs
    return 0


def cmd_stop(args) -> int:
    bad = False
    for name in reversed(SERVICES):
        msg = stop_service(args.run_dir, name, args.timeout)
        bad |= "STILL RUNNING" in msg
        print(f"{name:15s} {msg}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/stack", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["start", "stop", "status", "env"])
    ap.add_argument("--run-dir", type=Path, default=Path(os.environ.get("FP8_GRPO_STACK_DIR", DEFAULT_RUN_DIR)))
    ap.add_argument("--prefect-port", type=int, default=4200)
    ap.add_argument("--mlflow-port", type=int, default=5000)
    ap.add_argument("--backend-store-uri", default=None, help="MLflow store (default: sqlite under the run dir)")
    ap.add_argument("--limit", type=int, default=1, help="concurrent flow runs of the worker")
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for a service (stop: before SIGKILL)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.run_dir = args.run_dir.resolve()
    if args.command == "stop" and args.timeout == 120:
        args.timeout = 30
    return {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "env": cmd_env}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
