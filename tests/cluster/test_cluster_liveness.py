"""Which trainer ranks are lost after a step error, with real Ray actors: a rank's process is
SIGKILLed while the error the flow sees is another rank's plain RuntimeError (gloo "connection reset"), which is no
actor error. ``cluster.runtime.lost_trainers`` must still name the dead rank, and only it."""
import os
import signal
import time

import pytest

from cluster.runtime import NAMESPACE, lost_trainers

pytestmark = pytest.mark.slow


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


class _Rank:
    def cpu(self) -> dict:
        return {"kind": "test"}

    def pid(self) -> int:
        return os.getpid()

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)


def test_lost_trainers_probes_after_a_non_actor_error():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    names = [f"liveness-{os.getpid()}-{r}" for r in range(3)]
    try:
        ranks = [ray.remote(_Rank).options(name=n, num_cpus=0, max_concurrency=1).remote() for n in names]
        pids = ray.get([r.pid.remote() for r in ranks], timeout=120)
        gloo = RuntimeError("[gloo/transport/tcp/pair.cc] Connection reset by peer")
        assert lost_trainers(gloo, names, timeout_s=30) == []  # all alive: nothing lost

        ranks[2].busy.remote(60)  # rank 2 alive but stuck (in a collective, say): no answer, not lost
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        assert lost_trainers(gloo, names, timeout_s=5) == [names[1]]
        assert time.monotonic() - t0 < 30
        # an actor error names its actor directly (no probe)
        with pytest.raises(ray.exceptions.RayActorError) as died:
            ray.get(ranks[1].cpu.remote(), timeout=60)
        assert lost_trainers(died.value, names) == [names[1]]
    finally:
        for n in names:
            try:
                ray.kill(ray.get_actor(n, namespace=NAMESPACE))
            except ValueError:
                pass
        if started:
            ray.shutdown()


def test_a_stop_signal_while_waiting_on_workers_raises_itself_promptly():
    """A SIGTERM handler that raises neither KeyboardInterrupt nor SystemExit (Prefect's TerminationSignal inside a
    flow run) while the driver waits on its workers: raised as itself within one wait slice. Raised inside Ray's own
    wait it came out as ``SystemError: ... returned a result with an exception set``, or not at all."""
    import threading

    import ray

    from cluster.runtime import WAIT_SLICE_S, get_fail_fast

    class Stop(BaseException):
        pass

    def stop(signum, frame):
        raise Stop

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    ref = ray.remote(num_cpus=0)(_sleep).remote(60)
    old = signal.signal(signal.SIGTERM, stop)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(Stop):
            get_fail_fast([ref])
        assert time.monotonic() - t0 < 2.0 + 10 * WAIT_SLICE_S  # the signal came after 2 s: one slice later, 5x slack
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
        ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
