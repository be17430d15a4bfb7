"""A watchdog that outlives its parent: once the parent process is gone -- a normal exit, SIGTERM, or ``kill -9`` --
it ends every process the parent had started and that is still running (the run's temporary Prefect server,
Ray's GCS / raylet / agents and actor processes, vLLM engines in them), then exits itself.

    start_watchdog()        # from the driver; once per process (python -m flows.grpo, a Prefect flow-run process)

The watchdog is its own small process (``python -m process.watchdog PID START``, stdlib only, own session so a kill
of the driver's process group spares it). Every ``POLL_S`` it records the parent's descendants (PID + start time
from /proc, so a reused PID is never signalled). When the parent is gone it sends SIGTERM to the recorded processes
and to their own descendants, waits up to ``GRACE_S``, then SIGKILLs what is left. A process the parent started
within the last poll interval before dying is not seen (the next layer -- e.g. Ray's raylet ending its workers -- or
the caller covers those). Linux only (/proc); elsewhere ``start_watchdog`` does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 1.0  # one /proc scan costs ~3 ms of CPU with ~100 processes
GRACE_S = 8.0
_started: dict[int, int] = {}  # parent pid -> watchdog pid (one watchdog per process)


def start_time(pid: int) -> str | None:
    """Start time of a live (non-zombie) process in clock ticks since boot, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            out.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(p.name))
    return out


def descendants(roots: list[int], exclude: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``roots`` (not the roots), except ``exclude``."""
    kids, todo, out = _children(), list(roots), {}
    while todo:
        for c in kids.get(todo.pop(), []):
            if c != exclude and c not in out:
                st = start_time(c)
                if st is not None:
                    out[c] = st
                    todo.append(c)
    return out


def _signal(procs: dict[int, str], sig: int) -> list[int]:
    alive = [p for p, st in procs.items() if start_time(p) == st]
    for p in alive:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def watch(parent: int, parent_start: str) -> int:
    """Run until ``parent`` is gone, then end what it started. Returns the number of processes signalled."""
    me = os.getpid()
    seen: dict[int, str] = {}
    while start_time(parent) == parent_start:
        seen.update(descendants([parent], me))
        seen = {p: st for p, st in seen.items() if start_time(p) == st}
        time.sleep(POLL_S)
    # the orphans' own children (e.g. actor processes raylet started since the last poll)
    seen.update(descendants([p for p, st in seen.items() if start_time(p) == st], me))
    alive = _signal(seen, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(start_time(p) == st for p, st in seen.items()):
        time.sleep(0.2)
    _signal(seen, signal.SIGKILL)
    return len(alive)


def start_watchdog() -> int | None:
    """Start the watchdog of this process once (later calls return the same PID); None where /proc is missing."""
    me = os.getpid()
    if me in _started:
        return _started[me]
    st = start_time(me)
    if st is None:
        return None
    proc = subprocess.Popen([sys.executable, "-m", "process.watchdog", str(me), st],
                            cwd=str(Path(__file__).resolve().parents[1]), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _started[me] = proc.pid
    return proc.pid


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is for the driver; we clean up after it
    sys.exit(0 if watch(int(sys.argv[1]), sys.argv[2]) >= 0 else 1)
