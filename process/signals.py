"""Stop signals (SIGTERM, SIGINT) held while the driver is inside library code that must not be interrupted by an
exception from a signal handler, then delivered to the handlers that were in place: MLflow's database store (a stop
signal raised inside a write left its transaction open: tasks.tracking).

The other place a stop signal must not land is Ray's blocking ``ray.wait`` / ``ray.get``: a handler that raises
anything but KeyboardInterrupt / SystemExit there (Prefect's TerminationSignal, inside a flow run) escapes Ray's
Cython signal check, and the wait fails with ``SystemError: ... returned a result with an exception set`` (measured
with Ray 2.60). The driver therefore waits in Python (``cluster.runtime.wait``: non-blocking polls, sleeps between).
Holding the signals for whole waits instead was tried and is not a fix: Prefect's control listener acknowledges a
runner's cancel only while Prefect's own handler is installed, and holding its bridge lock for the waits kept the
listener out (a deployment cancel then left the flow-run process running past 30 s)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


@contextlib.contextmanager
def signals_held():
    """SIGTERM and SIGINT wait until the block ends, then reach the handlers that were in place. Python-level (the
    handlers are swapped for one that records the signal; a thread mask would not do: the kernel hands a process's
    signal to any thread that does not block it, and CPython runs the handler in the main thread anyway). Main thread
    only (only it may set handlers, and only it runs them); elsewhere a no-op.

    The swap holds Prefect's SIGTERM-bridge lock: Prefect's control listener (another thread) acknowledges a
    runner's cancel only while its own handler is installed, checking under that lock, so it waits out the block
    instead of finding the recorder and falling back to a crash-style stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    with _prefect_bridge_lock():
        # a handler installed outside Python (getsignal: None) cannot be put back: leave that signal alone
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) is not None}
        for s in old:
            signal.signal(s, lambda signum, frame: caught.append(signum))
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
    for s in caught:
        signal.raise_signal(s)


def _prefect_bridge_lock():
    try:  # Prefect 3.7's lock around installing / checking its SIGTERM bridge (a re-entrant lock)
        from prefect.utilities.engine import _prefect_sigterm_bridge_lock

        return _prefect_sigterm_bridge_lock
    except ImportError:  # another Prefect version: no listener to coordinate with
        return contextlib.nullcontext()


def _stop_signal_of(exc: BaseException | None) -> int | None:
    """The signal a stop exception stands for: Prefect's TerminationSignal (its ``signal``), the driver's SystemExit
    (code 128 + signal), KeyboardInterrupt (SIGINT); None for anything else."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code - 128 in (signal.SIGTERM, signal.SIGINT):
        return exc.code - 128
    sig = getattr(exc, "signal", None)
    return sig if type(exc).__name__ == "TerminationSignal" and isinstance(sig, int) else None


_redelivering = False


def redeliver_swallowed_stop_signals(delay_s: float = 0.05) -> None:
    """A stop signal whose handler raised inside a finalizer or weakref callback (garbage collection ran Python code
    when the signal arrived: measured with SQLAlchemy's event-registry callback in the driver) is swallowed there --
    Python prints "Exception ignored in ..." and carries on, and the run would not stop. This hook (chained to the
    one in place, which still prints) sends the same signal again ``delay_s`` later, from a thread, so the handler
    runs again in ordinary code. Idempotent; for the driver process."""
    global _redelivering
    if _redelivering:
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        previous(unraisable)
        sig = _stop_signal_of(unraisable.exc_value)
        if sig is not None:
            threading.Timer(delay_s, os.kill, (os.getpid(), sig)).start()

    sys.unraisablehook = hook
    _redelivering = True
