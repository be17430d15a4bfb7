"""Rollout fan-out end to end, in one asynchronous run: ``cluster.rollout_workers=2`` runs two vLLM engines and
``cluster.policy_workers=2`` two data-parallel trainers in the run's placement group (``STRICT_PACK``); every step
refits both engines from one object in Ray's object store (weights and the FP8 KV cache's Q/K/V scales calibrated
from that policy version; an engine refuses a stale pair), splits the prompt groups over them -- the step's own
rollout and the one generated ahead -- and trains on the gathered rollouts, one version old after the first step;
validation fans out too. The run is the FP8 KV recipe with ``FP8GRPO_CPU_CAP=avx2``: the driver's load-time check
picks the emulated KV cache and the cap reaches every Ray actor (runtime_env), which reports kind avx2 (the FP8 KV
recipe on an AVX2 CPU runs instead of killing the rollout actor). On the 2-core test machine this is a correctness
run (3 tiny steps), not a speed measurement."""

from __future__ import annotations

import pytest
from _ops import TINY
from _runs import check_refits_and_mismatch


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_engines_two_trainers_async_with_fp8_kv_scales_under_the_avx2_cap(tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.grpo import grpo
    from fp8core.cpu import cpu_caps

    capped = cpu_caps().hardware_kind != "other"  # a CPU without AVX2 runs the fan-out uncapped
    if capped:
        monkeypatch.setenv("FP8GRPO_CPU_CAP", "avx2")
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    s = grpo("configs/tiny_fp8_e2e_kv.yaml", [*TINY, f"run_dir={tmp_path / 'run'}", f"logger.mlflow.tracking_uri={db}",
                                              "checkpointing.enabled=false", "cluster.rollout_workers=2",
                                              "cluster.policy_workers=2", "cluster.placement_strategy=STRICT_PACK",
                                              "policy.threads=1", "policy.generation.vllm_cfg.threads=1",
                                              "grpo.max_num_steps=3", "grpo.async_grpo.enabled=true",
                                              "grpo.dynamic_sampling=false"])
    out = capsys.readouterr().out
    assert "x 2 trainer(s), rollout 2 x vLLM" in out and "step   3/3 | reward" in out, out[-3000:]
    assert s["steps_run"] == 3 and s["step_interval_s"] is not None
    c = MlflowClient(tracking_uri=db)
    run_id = s["mlflow_run_id"]
    run = c.get_run(run_id)
    assert run.data.params["cluster.rollout_workers"] == "2" and run.info.status == "FINISHED"

    def hist(key):
        return [m.value for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)]

    assert hist("rollout/engines") == [2.0, 2.0, 2.0]  # 2 prompts per step: one whole group per engine
    assert min(hist("time/rollout_engine_min_s")) > 0  # both engines generated
    assert hist("async/trajectory_age_max") == [0.0, 1.0, 1.0]
    assert hist("refit/weights_version") == [0.0, 1.0, 2.0]  # both engines loaded the policy of the step before
    # ... as both engines report it: step t's trajectories were generated with the policy of step t - 1 - age
    check_refits_and_mismatch(c, run_id, ages={1: 0, 2: 1, 3: 1})
    assert hist("async/rollouts_ahead") == [1.0, 1.0, 0.0]  # the last step generates none
    assert len(set(hist("kv/k_scale_mean"))) >= 2  # recalibrated from each version
    assert run.data.metrics["kv/k_scale_mean"] not in (0.0, 1.0)  # calibrated scales, not the unit default
    assert len(hist("val/accuracy")) == 1 and hist("rollout/generated_tokens")[0] > 0
    if capped:
        assert "rollout FP8 KV cache: fp8-emulated" in out and "cap avx2 from FP8GRPO_CPU_CAP" in out
        assert s["cpu_kind"] == "avx2" and s["cpu_rollout_kind"] == "avx2" and s["kv_mode"] == "fp8-emulated"
        assert run.data.params["cpu/kind"] == "avx2" and run.data.params["cpu/cap"] == "avx2"
        assert run.data.tags["rollout/kv_mode"] == "fp8-emulated"
        assert run.data.tags["cpu/rollout_kind"] == run.data.tags["cpu/policy_kind"] == "avx2"
