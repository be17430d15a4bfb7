"""The driver's waits on its workers (``cluster.runtime.wait`` / ``get`` / ``get_fail_fast``), with a real local Ray:
the same results as Ray's own wait, and a stop signal whose handler raises neither KeyboardInterrupt nor SystemExit
(Prefect's TerminationSignal in a flow run) is raised as itself, promptly. Inside Ray's blocking wait it came out as
``SystemError: ... returned a result with an exception set``, or was not acted on at all."""
import os
import signal
import threading
import time

import pytest

from cluster.runtime import NAMESPACE, WAIT_POLL_S, get, get_fail_fast, wait

pytestmark = pytest.mark.slow


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_wait_and_get_return_what_ray_returns(ray_local):
    ray = ray_local
    task = ray.remote(num_cpus=0)(_sleep)
    fast, slow = task.remote(0.0), task.remote(30)
    done, pending = wait([slow, fast, fast], num_returns=1)  # duplicates allowed, as in ray.get
    assert done == [fast] and pending == [slow]
    t0 = time.monotonic()
    done, pending = wait([slow, fast], timeout=0.5)  # timeout: what finished so far
    assert done == [fast] and pending == [slow] and 0.5 <= time.monotonic() - t0 < 5
    assert get(fast) == 0.0 and get([fast, fast]) == [0.0, 0.0]
    with pytest.raises(ray.exceptions.GetTimeoutError):
        get([fast, slow], timeout=0.2)
    ray.cancel(slow, force=True)


def test_a_stop_signal_while_waiting_on_workers_raises_itself_promptly(ray_local):
    ray = ray_local

    class Stop(BaseException):
        pass

    def stop(signum, frame):
        raise Stop

    ref = ray.remote(num_cpus=0)(_sleep).remote(60)
    old = signal.signal(signal.SIGTERM, stop)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(Stop):
            get_fail_fast([ref])
        # the signal came after 2 s; one poll later it is raised (WAIT_POLL_S = 0.02): 5 s is far above that
        assert time.monotonic() - t0 < 2.0 + 5.0
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
        ray.cancel(ref, force=True)
    assert WAIT_POLL_S <= 0.1  # the latency a wait adds stays small
