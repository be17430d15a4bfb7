"""TEST-ONLY worker kills (``testing.fault_kill_rollout_at_step`` / ``testing.fault_kill_policy_at_step``): the
worker-loss tests need a worker process to die by SIGKILL at a known point of a known step, as it would from the
OOM killer or a lost node. The flow's task arms the kill on the actor (``arm_fault_kill``) and the actor SIGKILLs
its own process at that point; a marker file under the run dir makes each kill happen once per run dir (a retried
step or a resumed run goes past it)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def claim_once(marker_dir: str | Path, what: str, step: int) -> bool:
    """True the first time ``(what, step)`` is claimed under ``marker_dir`` (an O_EXCL marker file), else False."""
    d = Path(marker_dir) / "faults"
    d.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(d / f"{what}_step_{step:06d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no exception, no reply -- what the caller sees of a crashed worker."""
    os.kill(os.getpid(), signal.SIGKILL)
