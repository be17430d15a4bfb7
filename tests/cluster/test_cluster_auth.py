"""Ray token authentication: every Ray the project starts requires Ray's token; the token file is
random, mode 0600, under the run (or stack) dir, never $HOME; ``ray.address`` clusters need the user's token path.

The refusal test runs the Ray head and every client in separate processes: Ray caches the token per process."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster.auth import TOKEN_FILE, check_token_file, ray_auth, write_token_file
from configs.schema import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny_bf16.yaml"


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(key, raising=False)


def test_token_file_is_random_private_and_replaced(tmp_path):
    a = write_token_file(tmp_path)
    first = a.read_text()
    assert a == tmp_path / TOKEN_FILE and stat.S_IMODE(a.stat().st_mode) == 0o600
    assert len(first) == 64 and int(first, 16) >= 0  # 256 random bits, hex
    b = write_token_file(tmp_path)
    assert b == a and b.read_text() != first and stat.S_IMODE(b.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [TOKEN_FILE]  # no temp file left behind


def test_token_file_checks_name_the_key(tmp_path):
    path = write_token_file(tmp_path)
    assert check_token_file(path, "ray.auth_token_path") == path.resolve()
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"^ray.auth_token_path: .*mode 644.*chmod 600"):
        check_token_file(path, "ray.auth_token_path")
    with pytest.raises(ConfigError, match=r"^RAY_AUTH_TOKEN_PATH: .*does not exist"):
        check_token_file(tmp_path / "missing", "RAY_AUTH_TOKEN_PATH")
    empty = tmp_path / "empty"
    empty.touch(0o600)
    with pytest.raises(ConfigError, match=r"^ray.auth_token_path: .*is empty"):
        check_token_file(empty, "ray.auth_token_path")


def test_local_ray_always_uses_a_token(tmp_path, clean_env, monkeypatch):
    cfg = Config()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the old default: ignored for a Ray we start
    auth = ray_auth(cfg, tmp_path / "run")
    assert auth == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "run" / TOKEN_FILE)}
    assert stat.S_IMODE((tmp_path / "run" / TOKEN_FILE).stat().st_mode) == 0o600
    # a token path in the environment (the stack's, the test harness's, an earlier run in this process) is reused
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", auth["RAY_AUTH_TOKEN_PATH"])
    assert ray_auth(cfg, tmp_path / "other")["RAY_AUTH_TOKEN_PATH"] == auth["RAY_AUTH_TOKEN_PATH"]
    assert not (tmp_path / "other").exists()


def test_cluster_address_needs_a_token_path(tmp_path, clean_env, monkeypatch):
    cfg = load_config(RECIPE, ["ray.address=10.0.0.1:6379"])
    with pytest.raises(ConfigError, match=r"^ray.auth_token_path: ray.address=10.0.0.1:6379 needs the cluster"):
        ray_auth(cfg, tmp_path)
    token = write_token_file(tmp_path / "mine")
    cfg2 = load_config(RECIPE, ["ray.address=10.0.0.1:6379", f"ray.auth_token_path={token}"])
    assert ray_auth(cfg2, tmp_path) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert ray_auth(cfg, tmp_path)["RAY_AUTH_TOKEN_PATH"] == str(token)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # explicit opt-out for a cluster without authentication
    assert ray_auth(cfg, tmp_path) == {"RAY_AUTH_MODE": "disabled"}
    token.chmod(0o640)
    with pytest.raises(ConfigError, match=r"^ray.auth_token_path: .*group/others"):
        ray_auth(cfg2, tmp_path)


@pytest.mark.slow
def test_flow_rejects_a_bad_token_path_before_any_work(tmp_path):
    """Through the CLI: a cluster address without a usable token fails naming ray.auth_token_path, before Ray."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    r = subprocess.run([sys.executable, "-m", "flows.grpo", str(RECIPE), f"run_dir={tmp_path / 'run'}",
                        "ray.address=127.0.0.1:1", f"ray.auth_token_path={tmp_path / 'nope'}",
                        "logger.mlflow_enabled=false"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "ray.auth_token_path: Ray token file" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (tmp_path / "run" / "config.resolved.yaml").exists()  # nothing started


HEAD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from configs.schema import Config
    from cluster.runtime import init_ray
    import ray
    import signal
    def mine(signum, frame): ...
    signal.signal(signal.SIGTERM, mine)  # stands for Prefect's SIGTERM bridge, which a cancel needs installed
    init_ray(Config(), Path(sys.argv[1]))
    print("SIGTERM_HANDLER_KEPT", signal.getsignal(signal.SIGTERM) is mine, flush=True)
    print("ADDRESS", ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes stdin
    ray.shutdown()
""")

CLIENT = textwrap.dedent("""
    import sys
    import ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
        print("RESULT", ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60), flush=True)
    except Exception as e:
        print("REFUSED", type(e).__name__, str(e).splitlines()[0][:300], flush=True)
""")


@pytest.mark.slow
def test_client_without_the_token_is_refused(tmp_path):
    """A Ray started by the project (``init_ray``, a head in its own process) runs a task for a client holding the
    run's token, and refuses a client with no token, with another token, or with auth turned off. ``init_ray`` leaves
    the caller's SIGTERM handler installed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base["HOME"] = str(tmp_path / "home")  # no ~/.ray/auth_token to fall back on
    base["RAY_TMPDIR"] = f"/tmp/ray-auth-{os.getpid()}"
    run_dir = tmp_path / "run"
    head = subprocess.Popen([sys.executable, "-c", HEAD, str(run_dir)], cwd=ROOT, env=base, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line, kept = "", None
        while not line.startswith("ADDRESS"):
            line = head.stdout.readline()
            assert line or head.poll() is None, "Ray head exited before printing its address"
            if line.startswith("SIGTERM_HANDLER_KEPT"):
                kept = line.split()[1]
        # ray.init swaps in its own SIGTERM handler; init_ray puts the caller's back (a Prefect cancel needs it)
        assert kept == "True", kept
        address = line.split()[1]
        token = run_dir / TOKEN_FILE
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert not (tmp_path / "home").exists()  # nothing under $HOME

        def client(**env) -> tuple[str, str]:
            r = subprocess.run([sys.executable, "-c", CLIENT, address], cwd=ROOT, env={**base, **env},
                               capture_output=True, text=True, timeout=180)
            out = [ln for ln in r.stdout.splitlines() if ln.startswith(("RESULT", "REFUSED"))]
            assert out, r.stdout[-2000:] + r.stderr[-2000:]
            return out[-1], r.stderr

        wrong = write_token_file(tmp_path / "wrong")
        envs = [{"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}, {}, {"RAY_AUTH_MODE": "disabled"},
                {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}]
        with ThreadPoolExecutor(len(envs)) as pool:  # the four clients at once: each is mostly Ray's start-up wait
            results = list(pool.map(lambda e: client(**e), envs))
        assert results[0][0] == "RESULT 42", results[0]
        for env, (out, err) in zip(envs[1:], results[1:], strict=True):
            assert out.startswith("REFUSED"), (env, out)
            # refused by the server's token check (GCS answers Unauthenticated), not by anything else
            assert "Authentication token is missing or incorrect" in err, (env, err[-2000:])
            print(env, out)
        secret = token.read_text()
        head.stdin.close()
        rest = head.stdout.read()
        assert head.wait(60) == 0, rest[-2000:]
        assert secret not in line + rest  # never printed
    finally:
        if head.stdin and not head.stdin.closed:
            head.stdin.close()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
        shutil.rmtree(base["RAY_TMPDIR"], ignore_errors=True)  # the head's Ray session dir
