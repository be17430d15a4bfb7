"""A stop signal whose handler raised inside a weakref callback (Python swallows that exception) is delivered again
by process.signals.redeliver_swallowed_stop_signals, so the driver still stops; without the hook it runs on."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PROGRAM = """
import signal, sys, time, weakref
from process.signals import redeliver_swallowed_stop_signals
if sys.argv[1] == "on":
    redeliver_swallowed_stop_signals()
def handler(signum, frame):
    raise SystemExit(128 + signum)  # the driver's SIGTERM handler (flows.grpo)
signal.signal(signal.SIGTERM, handler)
class Thing:
    pass
def collected(ref):
    signal.raise_signal(signal.SIGTERM)  # arrives while garbage collection runs Python code
thing = Thing()
ref = weakref.ref(thing, collected)
del thing
t0 = time.monotonic()
while time.monotonic() - t0 < 3:
    time.sleep(0.01)
print("ran on")
"""


@pytest.mark.parametrize("hook", ["on", "off"])
def test_a_swallowed_sigterm_is_delivered_again(hook):
    out = subprocess.run([sys.executable, "-c", _PROGRAM, hook], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "Exception ignored" in out.stderr, out.stderr  # the first delivery was swallowed
    if hook == "on":
        assert out.returncode == 128 + 15 and "ran on" not in out.stdout, (out.returncode, out.stderr[-2000:])
    else:  # the control: nothing stops the process
        assert out.returncode == 0 and "ran on" in out.stdout, (out.returncode, out.stderr[-2000:])
