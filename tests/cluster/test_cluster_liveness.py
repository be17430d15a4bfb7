"""Which trainer ranks are lost after a step error, with real Ray actors: a rank's process is
SIGKILLed while the error the flow sees is another rank's plain RuntimeError (gloo "connection reset"), which is no
actor error. ``cluster.runtime.lost_trainers`` must still name the dead rank, and only it."""
import os
import signal
import time

import pytest

from cluster.runtime import NAMESPACE, lost_trainers

pytestmark = pytest.mark.slow


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
