"""Ray's token authentication for every Ray this project starts or joins.

Ray 2.60 cannot be restricted to loopback from ``ray.init`` (it resolves 127.0.0.1 to the node IP; its gRPC ports
listen on all interfaces), so every Ray this project starts runs with Ray's token authentication
(``RAY_AUTH_MODE=token``): a random 256-bit token in a file created with mode 0600 under the run dir (or the one the
environment already names in ``RAY_AUTH_TOKEN_PATH``, e.g. the stack's or the test harness's), never under $HOME,
never printed or logged (only its path is). A client without the token is refused. For ``ray.address`` clusters
the user names the cluster's token file (``ray.auth_token_path`` or ``RAY_AUTH_TOKEN_PATH``); only an explicit
``RAY_AUTH_MODE=disabled`` in the environment connects without one. See :func:`ray_auth`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from configs.schema import Config

TOKEN_FILE = "ray_auth_token"


def write_token_file(directory: Path) -> Path:
    """A fresh random Ray token (256 bits, hex) in ``directory/ray_auth_token``: created with mode 0600 (never readable
    by others, not even for an instant) and moved into place atomically. Returns the path; the token is never
    printed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TOKEN_FILE
    tmp = directory / f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.replace(tmp, path)
    return path


def check_token_file(path: str | Path, key: str) -> Path:
    """A token file a client may use: exists, non-empty, not readable or writable by group or others. ``key`` (the
    config key or the environment variable that named it) starts the error message."""
    from configs.schema import ConfigError

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}: Ray token file {p} does not exist (or is not a file)")
    mode = p.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"{key}: Ray token file {p} has mode {mode:o}: group/others may read it; run chmod 600 {p}")
    if not p.read_text().strip():
        raise ConfigError(f"{key}: Ray token file {p} is empty")
    return p.resolve()


def ray_auth(cfg: Config, run_dir: Path) -> dict[str, str]:
    """The Ray authentication environment of this run (checked before any work starts; applied by ``init_ray``).

    Local Ray (no ``ray.address``): always ``RAY_AUTH_MODE=token``, with ``ray.auth_token_path`` if set, else the
    token file ``RAY_AUTH_TOKEN_PATH`` already names (the stack's, the test harness's, or one an earlier run in this
    process created: Ray caches the token per process), else a new one under ``run_dir``. ``ray.address``: the
    cluster's token from ``ray.auth_token_path``, ``RAY_AUTH_TOKEN_PATH`` or ``RAY_AUTH_TOKEN``; without any, a
    ConfigError naming ``ray.auth_token_path`` -- unless the environment says ``RAY_AUTH_MODE=disabled`` explicitly
    (a cluster run without authentication, the user's choice). Returns the variables (a path, never the token)."""
    from configs.schema import ConfigError

    if cfg.ray.auth_token_path:
        return {"RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": str(check_token_file(cfg.ray.auth_token_path, "ray.auth_token_path"))}
    env_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if cfg.ray.address:
        if env_path:
            return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(check_token_file(env_path,
                                                                                          "RAY_AUTH_TOKEN_PATH"))}
        if os.environ.get("RAY_AUTH_TOKEN"):
            return {"RAY_AUTH_MODE": "token"}
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            return {"RAY_AUTH_MODE": "disabled"}
        raise ConfigError(f"ray.auth_token_path: ray.address={cfg.ray.address} needs the cluster's Ray token: set "
                          "ray.auth_token_path (or RAY_AUTH_TOKEN_PATH) to the token file the cluster was started with "
                          "(or RAY_AUTH_MODE=disabled for a cluster without authentication)")
    if env_path and Path(env_path).is_file():
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(check_token_file(env_path, "RAY_AUTH_TOKEN_PATH"))}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(write_token_file(run_dir))}


def apply_auth(auth: dict[str, str]) -> None:
    """Put the auth variables in this process's environment (Ray's processes and actors inherit them) and make Ray's
    per-process token cache re-read them (a new token path after an earlier Ray in this process)."""
    os.environ.update(auth)
    if auth.get("RAY_AUTH_MODE") == "token" and "RAY_AUTH_TOKEN_PATH" in auth:
        os.environ.pop("RAY_AUTH_TOKEN", None)  # the file is the one source (RAY_AUTH_TOKEN would win over it)
    try:
        from ray._raylet import AuthenticationTokenLoader
        from ray._raylet import Config as RayConfig

        RayConfig.initialize("")  # the auth mode is read from RAY_AUTH_MODE when the config is (re)initialized
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - other Ray versions read the environment at init
        pass
