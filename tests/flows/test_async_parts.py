"""The pieces of asynchronous GRPO and of a resume's MLflow history that need no workers: the overlap and the step
interval as the flow computes them, the CPU pinning plan, and a resumed run's metrics logged once per step (a real
MLflow sqlite store)."""
import pytest

from configs.schema import ConfigError, load_config
from flows.rl_step import _overlap
from flows.run_report import step_interval

RECIPE = "configs/tiny_fp8_e2e.yaml"


def test_overlap_counts_the_train_time_covered_by_rollouts():
    assert _overlap((10.0, 20.0), [(8.0, 12.0), (15.0, 30.0)]) == pytest.approx(2.0 + 5.0)
    assert _overlap((10.0, 20.0), [(0.0, 5.0), (25.0, 30.0)]) == 0.0
    assert _overlap((10.0, 20.0), []) == 0.0


def test_step_interval_is_the_mean_gap_between_step_ends():
    hist = [{"time/step_end_unix": t} for t in (100.0, 103.0, 107.0, 109.0)]
    assert step_interval(hist) == pytest.approx(3.0)
    assert step_interval(hist[:1]) is None and step_interval([]) is None


def test_pinning_gives_each_worker_its_own_cpus(monkeypatch):
    import os

    from cluster.runtime import cpu_pins, pin_env

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 9})
    cfg = load_config(RECIPE, ["cluster.pin_cpus=true", "policy.threads=1", "cluster.policy_workers=2",
                               "policy.generation.vllm_cfg.threads=2"])
    pins = cpu_pins(cfg)
    assert pins == [[4], [5], [6, 7]]
    assert pin_env(pins, 2) == {"FP8GRPO_CPUS": "6,7"} and pin_env(None, 0) == {}
    assert cpu_pins(load_config(RECIPE, [])) is None
    with pytest.raises(ConfigError, match=r"^cluster.pin_cpus: .*\(2 \+ 2 \+ 3 = 7.*5 CPUs"):
        cpu_pins(load_config(RECIPE, ["cluster.pin_cpus=true", "policy.threads=2", "cluster.policy_workers=2",
                                      "policy.generation.vllm_cfg.threads=3"]))


def test_apply_cpu_pin_pins_every_thread_of_the_process(monkeypatch):
    import os
    import threading

    from fp8core.cpu import apply_cpu_pin

    before = os.sched_getaffinity(0)
    cpu = min(before)
    started, stop = threading.Event(), threading.Event()
    seen = {}

    def worker():
        started.set()
        stop.wait()
        seen["cpus"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    try:
        monkeypatch.setenv("FP8GRPO_CPUS", str(cpu))
        assert apply_cpu_pin() == [cpu]
        assert os.sched_getaffinity(0) == {cpu}
        stop.set()
        t.join()
        assert seen["cpus"] == {cpu}  # a thread started before the pin is pinned too
        monkeypatch.delenv("FP8GRPO_CPUS")
        assert apply_cpu_pin() is None
    finally:
        stop.set()
        os.sched_setaffinity(0, before)


def test_a_resumed_run_logs_each_step_once(tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks import tracking

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    c = MlflowClient(tracking_uri=uri)
    run_id = c.create_run(c.create_experiment("e")).info.run_id
    for step in (1, 2, 3):  # the stopped run: steps 1-3 logged, its last checkpoint at step 2
        tracking.log_metrics(uri, run_id, {"reward/mean": float(step), "time/step_s": 1.0}, step)
    try:
        assert tracking.mark_replayed(uri, run_id, 2) == [3]
        for step in (3, 4):  # the resumed run replays step 3, then goes on
            tracking.log_metrics(uri, run_id, {"reward/mean": 10.0 * step, "time/step_s": 2.0,
                                               "time/checkpoint_s": 0.5}, step)
        hist = sorted((m.step, m.value) for m in c.get_metric_history(run_id, "reward/mean"))
        assert hist == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
        # a key the stopped run had not logged at the replayed step is written
        assert [m.step for m in c.get_metric_history(run_id, "time/checkpoint_s")] == [3, 4]
    finally:
        tracking._REPLAYED.pop(run_id, None)
