"""Progress bars appear on a terminal and stay out of logs: the same code under a pseudo-terminal draws a tqdm bar,
with stdout to a pipe prints nothing extra, and FP8GRPO_PROGRESS=off silences the terminal too."""
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = ("from process.progress import progress\n"
           "for _ in progress(range(3), desc='phase', unit='step'):\n    pass\nprint('done')\n")


def _on_pty(env: dict) -> str:
    """Run the snippet with stdout and stderr on a pseudo-terminal; everything it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size (0x0 draws none)
    p = subprocess.Popen([sys.executable, "-c", SNIPPET], cwd=ROOT, env=env, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    p.wait(60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_bar_on_a_terminal_only():
    env = {k: v for k, v in os.environ.items() if k != "FP8GRPO_PROGRESS"}
    out = _on_pty(env)
    assert "phase:" in out and "/3 [" in out and "done" in out, out
    piped = subprocess.run([sys.executable, "-c", SNIPPET], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
    assert piped.stdout == "done\n" and "phase" not in piped.stderr, (piped.stdout, piped.stderr)
    silenced = _on_pty({**env, "FP8GRPO_PROGRESS": "off"})
    assert "phase" not in silenced and "done" in silenced, silenced
