"""The refit group under a dying member, through the pipeline's own refit task on real Ray actors: 2 engines and a
trainer (tests/ops/test_fanout.py runs 2 x 2 trainers over the group), engine 1 SIGKILLed in the middle of a refit over the wire (after its first tensor). The
others fail within the collective timeout, the task raises the dead engine's own actor error (what the flow's engine
recovery acts on), Ray restarts the engine, and the next refit forms the group again and loads every engine."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_an_engine_dying_mid_refit_fails_the_refit_naming_it_and_the_group_forms_again(tmp_path):
    import ray
    from ray.exceptions import RayActorError

    from cluster.runtime import actor, await_actors, get, init_ray, start_workers, stop_workers
    from configs.schema import load_config
    from diagnostics.mismatch import quick_sft_model
    from process.faults import TestHooks, arm_kill
    from tasks import rl
    from tasks.context import RunContext

    model_dir = quick_sft_model(ROOT / "runs" / "test-env" / "models")
    timeout = 20
    cfg = load_config(ROOT / "configs" / "tiny_fp8_e2e.yaml", [
        "cluster.rollout_workers=2", "cluster.policy_workers=1", f"cluster.collective_timeout_s={timeout}",
        "ray.rollout_worker.num_cpus=0.5", "ray.policy_worker.num_cpus=0.5",
        "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", f"run_dir={tmp_path}",
        "testing.fault_kill_rollout_at_step=15"])  # never due here (no step runs): it gives the actors their TEST-ONLY hooks
    started = init_ray(cfg, tmp_path / "ray")
    workers = None
    try:
        workers = start_workers(cfg, model_dir, tmp_path, "refit-faults", hooks=TestHooks.from_config(cfg, tmp_path))
        ctx = RunContext.from_config(cfg, policy=workers.policy_name, policy_ranks=workers.policy_names,
                                     rollouts=workers.rollout_names, run_id=None, tracking_uri=None,
                                     model_dir=str(model_dir), checkpoint_uri=None)
        assert ctx.refit_transport == "collective"
        first = rl.refit.fn(ctx)
        assert first["refit/group_generation"] == 1.0 and first["refit/bytes_sent"] > 0

        dying = workers.rollout_names[1]
        get(actor(dying).__ray_call__.remote(arm_kill))
        t0 = time.monotonic()
        with pytest.raises(RayActorError) as err:
            rl.refit.fn(ctx)
        assert time.monotonic() - t0 < timeout + 30
        assert dying in str(err.value) or err.value.actor_id == actor(dying)._actor_id.hex()

        await_actors(ctx.rollouts, 300)  # Ray restarted it (cluster.rollout_max_restarts)
        again = rl.refit.fn(ctx)
        assert again["refit/group_generation"] == 2.0  # formed again: the restarted engine was in no group
        version = again["refit/weights_version"]
        assert [get(actor(n).stats.remote())["weights_version"] for n in ctx.rollouts] == [version, version]
    finally:
        stop_workers(workers)
        if started:
            ray.shutdown()
