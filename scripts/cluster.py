"""A multi-node Ray cluster on this machine (or the head of a real one): a head and worker nodes as separate
``ray start`` processes, with token authentication, for runs with ``ray.address``.

    scripts/cluster start [--dir runs/cluster] [--workers 1] [--head-cpus 1] [--worker-cpus 2] [--port 0]
    scripts/cluster env   [--dir ...]     # eval "$(scripts/cluster env)": RAY_ADDRESS, RAY_AUTH_* for the CLI
    scripts/cluster stop  [--dir ...]

``start`` writes a random token (``<dir>/ray_auth_token``, mode 0600, never printed), starts the head
(``ray start --head``, dashboard off, temp dir under /tmp: Ray's socket paths must stay short) and ``--workers``
worker nodes (``ray start --address``), and writes ``<dir>/cluster.json`` (address, token path). Every process of
the cluster carries ``FP8_GRPO_CLUSTER=<dir>`` in its environment, which is how ``stop`` finds exactly them
(``ray stop`` would end every Ray of this user on the machine). A run then uses it with
``ray.address=<address> ray.auth_token_path=<dir>/ray_auth_token`` (or the ``env`` variables).

On one machine the nodes share the CPUs: this exercises the multi-node code path (placement over nodes, objects
between raylets, actors on another node), not a speed-up.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import process.quiet  # noqa: E402,F401  third-party start-up noise off
from cluster.auth import TOKEN_FILE, write_token_file  # noqa: E402

MARK = "FP8_GRPO_CLUSTER"


def _marked(value: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={value}".encode() in env:
            out.append(int(p.name))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env(d: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update({MARK: str(d), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(d / TOKEN_FILE),
                "RAY_USAGE_STATS_ENABLED": "0", "PATH": str(Path(sys.executable).parent) + os.pathsep
                + os.environ.get("PATH", "")})
    return env


def cmd_start(args) -> int:
    d = args.dir
    if _marked(str(d)):
        raise SystemExit(f"cluster: already running for {d}; run `scripts/cluster stop --dir {d}` first")
    d.mkdir(parents=True, exist_ok=True)
    write_token_file(d)
    env = _env(d)
    ray = str(Path(sys.executable).with_name("ray"))
    port = args.port or _free_port()
    tmp = f"/tmp/ray-cl-{hashlib.sha1(str(d).encode()).hexdigest()[:8]}"
    log = open(d / "cluster.log", "ab")  # noqa: SIM115
    t0 = time.monotonic()
    try:
        head = [ray, "start", "--head", f"--port={port}", f"--num-cpus={args.head_cpus}", "--num-gpus=0",
                f"--temp-dir={tmp}", "--include-dashboard=false", "--disable-usage-stats"]
        subprocess.run(head, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=180, cwd=ROOT)
        ip = _node_ip(env)
        address = f"{ip}:{port}"
        for _ in range(args.workers):
            subprocess.run([ray, "start", f"--address={address}", f"--num-cpus={args.worker_cpus}",
                            "--num-gpus=0", "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT,
                           check=True, timeout=180, cwd=ROOT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        log.close()
        _stop(d)
        raise SystemExit(f"cluster: `{' '.join(e.cmd[:3])} ...` failed; see {d / 'cluster.log'}") from None
    log.close()
    state = {"address": address, "token_path": str(d / TOKEN_FILE), "head_cpus": args.head_cpus,
             "workers": args.workers, "worker_cpus": args.worker_cpus, "temp_dir": tmp}
    (d / "cluster.json").write_text(json.dumps(state, indent=1))
    print(f"cluster: head {address} + {args.workers} worker node(s) up in {time.monotonic() - t0:.0f}s "
          f"(token auth on; token file {d / TOKEN_FILE})\n"
          f"  run with:  ray.address={address} ray.auth_token_path={d / TOKEN_FILE}\n"
          f"  stop:      scripts/cluster stop --dir {d}", flush=True)
    return 0


def _node_ip(env: dict) -> str:
    """The address Ray's head bound (Ray rewrites loopback to the node's IP)."""
    code = "import ray._private.services as s; print(s.get_node_ip_address())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip().splitlines()[-1]


def _stop(d: Path, timeout: float = 20) -> int:
    pids = _marked(str(d))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while _marked(str(d)) and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = _marked(str(d))
        if not pids:
            break
    return len(_marked(str(d)))


def cmd_stop(args) -> int:
    n = len(_marked(str(args.dir)))
    left = _stop(args.dir)
    (args.dir / "cluster.json").unlink(missing_ok=True)
    print(f"cluster: stopped {n - left} process(es)" + (f"; {left} STILL RUNNING" if left else ""))
    return 1 if left else 0


def cmd_env(args) -> int:
    state = json.loads((args.dir / "cluster.json").read_text())
    print(f"export RAY_ADDRESS='{state['address']}'\nexport RAY_AUTH_MODE=token\n"
          f"export RAY_AUTH_TOKEN_PATH='{state['token_path']}'")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["start", "stop", "env"])
    ap.add_argument("--dir", type=Path, default=ROOT / "runs" / "cluster")
    ap.add_argument("--workers", type=int, default=1, help="worker nodes besides the head")
    ap.add_argument("--head-cpus", type=int, default=1)
    ap.add_argument("--worker-cpus", type=int, default=2)
    ap.add_argument("--port", type=int, default=0, help="the head's GCS port (0 = a free one)")
    args = ap.parse_args(argv)
    args.dir = args.dir.resolve()
    return {"start": cmd_start, "stop": cmd_stop, "env": cmd_env}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
