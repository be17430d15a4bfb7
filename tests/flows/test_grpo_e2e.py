"""End to end: the tiny FP8 (blockwise, FP8 KV cache) recipe runs 2 RL steps through the real pipeline -- Prefect flow
and subflows, Ray actors (PolicyWorker with fp8core FP8 training, RolloutWorker with a vLLM engine), MLflow on sqlite,
checkpoints on a local moto S3 server -- then resumes from the latest *complete* checkpoint into the same MLflow run."""
from pathlib import Path

import pytest
from _runs import check_refits_and_mismatch

ROOT = Path(__file__).resolve().parents[2]
METRICS = ["reward/mean", "val/accuracy", "mismatch/token_mult_prob_error", "mismatch/kl_k3_train_rollout",
           "clip/lower_neg_adv_frac", "clip/upper_pos_adv_frac", "clip/bound_low", "clip/bound_high", "policy/entropy",
           "response/length_mean", "is/weight_mean", "kv/k_scale_mean", "kv/v_scale_max", "loss/pg", "train/grad_norm",
           "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s", "time/step_s", "time/rollout_s",
           "time/train_s", "time/refit_s", "time/share_rollout", "time/share_train", "time/share_calibration",
           "time/checkpoint_s", "time/orchestration_s", "time/share_orchestration", "time/share_refit_kv"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_fp8_two_steps_then_resume_from_s3(tmp_path, moto_s3, capsys):
    import s3fs
    from mlflow.tracking import MlflowClient

    from flows.grpo import grpo
    from fp8core.cpu import cpu_caps
    from storage.checkpoint import CheckpointStore

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto_s3}).mkdir("ckpt-bucket")
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [f"run_dir={tmp_path / 'run'}", f"logger.mlflow.tracking_uri={db}",
              "checkpointing.checkpoint_dir=s3://ckpt-bucket/tiny-e2e", "checkpointing.save_period=1",
              "checkpointing.keep_last_k=3", "grpo.val_period=1", "grpo.max_val_samples=8",
              # a small batch keeps CI fast; the recipe's 16 x 8 is for real runs
              "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
              "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
              f"bootstrap.assets_dir={ROOT / 'runs' / 'test-env' / 'ops-assets'}", "bootstrap.sft_steps=30",
              # the 30-step warm start (shared with the ops tests) often scores 0 on every sample: DAPO's filter
              # would then drop every group and no update would run (no loss/grad metrics); this test is about the
              # pipeline, so keep every group
              "grpo.dynamic_sampling=false"]
    recipe = str(ROOT / "configs" / "tiny_fp8_e2e_kv.yaml")

    s1 = grpo(recipe, common + ["grpo.max_num_steps=2"])
    out = capsys.readouterr().out
    assert "step   1/2 | reward" in out and "step   2/2 | reward" in out and "MLflow run" in out
    assert s1["steps_run"] == 2 and s1["checkpoint"] == "s3://ckpt-bucket/tiny-e2e/step_000002"
    assert 1.0 <= s1["mean_token_mult_prob_error"] < 2.0

    c = MlflowClient(tracking_uri=db)
    run = c.get_run(s1["mlflow_run_id"])
    missing = [k for k in METRICS if k not in run.data.metrics]
    assert not missing, missing
    # the overhead shares are fractions of the step (what the bench's orchestration row reads)
    assert 0.0 <= run.data.metrics["time/share_orchestration"] < 1.0
    assert 0.0 < run.data.metrics["time/share_refit_kv"] < 1.0
    assert run.data.tags["recipe"] == "tiny_fp8_e2e_kv" and run.data.tags["precision"] == "fp8-e2e-kvfp8"
    assert run.data.params["policy.megatron_cfg.fp8_cfg.fp8_recipe"] == "blockwise"
    assert run.data.params["policy.generation.vllm_cfg.kv_cache_dtype"] == "fp8"
    # FP8 KV on every CPU: vLLM's native cache where it has AVX-512/AMX, the emulated one elsewhere (docs/cpu-kinds.md)
    caps = cpu_caps()
    assert run.data.params["cpu/kind"] == caps.kind and run.data.params["cpu/model"] == caps.model
    assert run.data.tags["rollout/kv_mode"] == ("fp8-native" if caps.native_fp8_kv else "fp8-emulated")
    assert run.data.tags["cpu/rollout_kind"] == run.data.tags["cpu/policy_kind"] == caps.kind
    assert s1["cpu_kind"] == caps.kind
    assert "CPU " in out and f"kind {caps.kind}" in out
    assert [m.step for m in c.get_metric_history(run.info.run_id, "val/accuracy")] == [0, 1, 2]
    arts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"config.resolved.yaml", "curves.png", "samples", "checkpoints", "summary.json"} <= arts, arts
    assert run.info.status == "FINISHED"

    store = CheckpointStore("s3://ckpt-bucket/tiny-e2e")
    assert store.complete_steps() == [1, 2]
    assert store.load_state(2)["mlflow_run_id"] == run.info.run_id
    # A crash while writing step 2: files present, manifest missing -> resume must use step 1.
    store.fs.rm("ckpt-bucket/tiny-e2e/step_000002/manifest.json")

    s2 = grpo(recipe, common + ["grpo.max_num_steps=3", "checkpointing.resume=true"])
    out = capsys.readouterr().out
    assert "resume: checkpoint s3://ckpt-bucket/tiny-e2e/step_000001 (step 1)" in out
    assert s2["mlflow_run_id"] == run.info.run_id and (s2["first_step"], s2["last_step"]) == (2, 3)
    steps = sorted({m.step for m in c.get_metric_history(run.info.run_id, "reward/mean")})
    assert steps == [1, 2, 3]
    assert store.complete_steps() == [1, 2, 3] and c.get_run(run.info.run_id).info.status == "FINISHED"
    # every step (the resumed ones too) generated on the weights its refit loaded; FP8 KV mismatch within bound
    check_refits_and_mismatch(c, run.info.run_id)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_engine_that_skips_a_refit_fails_the_run(tmp_path):
    """The negative control of the engine-version checks: engines that ignore step 2's refit (TEST-ONLY
    ``testing.fault_skip_refit_at_step``) still hold the step-0 policy, so step 2's rollout refuses to generate and
    the run fails naming the missed step; the engines' reported version shows the one step that ran right."""
    from _ops import TINY
    from _runs import step_history
    from mlflow.tracking import MlflowClient

    from flows.grpo import grpo

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(Exception, match="holds the policy weights of step 0, the rollout needs step 1: it missed a "
                                        "refit"):
        grpo(str(ROOT / "configs" / "tiny_fp8_e2e.yaml"),
             [*TINY, f"run_dir={tmp_path / 'run'}", f"logger.mlflow.tracking_uri={db}", "checkpointing.enabled=false",
              "grpo.dynamic_sampling=false", "testing.fault_skip_refit_at_step=2"])
    c = MlflowClient(tracking_uri=db)
    (run,) = c.search_runs([c.get_experiment_by_name("fp8-grpo").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags.get("testing.fault")
    assert step_history(c, run.info.run_id, "rollout/weights_version") == {1: 0.0}
    assert sorted(step_history(c, run.info.run_id, "reward/mean")) == [1]


class _History:
    """A stand-in MLflow client holding per-step metric histories and a precision tag."""

    def __init__(self, precision: str, **metrics: dict[int, float]):
        from types import SimpleNamespace

        self.run = SimpleNamespace(data=SimpleNamespace(tags={"precision": precision}))
        self.metrics = {k.replace("__", "/"): v for k, v in metrics.items()}

    def get_run(self, run_id):
        return self.run

    def get_metric_history(self, run_id, key):
        from types import SimpleNamespace

        return [SimpleNamespace(step=s, value=v) for s, v in self.metrics.get(key, {}).items()]


def test_run_checks_fail_on_a_stale_engine_or_a_mismatch_above_the_bound():
    from _runs import MISMATCH_BOUND, check_refits_and_mismatch

    good = dict(reward__mean={1: 0.1, 2: 0.2}, refit__weights_version={1: 0.0, 2: 1.0},
                mismatch__token_mult_prob_error={1: 1.001, 2: 1.004})
    out = check_refits_and_mismatch(_History("fp8-e2e", **good, rollout__weights_version={1: 0.0, 2: 1.0}), "r")
    assert out["steps"] == [1, 2]
    with pytest.raises(AssertionError, match="engine weights per step"):  # step 2 generated on the step-0 policy
        check_refits_and_mismatch(_History("fp8-e2e", **good, rollout__weights_version={1: 0.0, 2: 0.0}), "r")
    with pytest.raises(AssertionError, match="engine weights per step"):  # no version reported at all
        check_refits_and_mismatch(_History("fp8-e2e", **good), "r")
    above = {**good, "mismatch__token_mult_prob_error": {1: 1.001, 2: MISMATCH_BOUND["fp8-e2e"] + 0.001}}
    with pytest.raises(AssertionError, match="above"):
        check_refits_and_mismatch(_History("fp8-e2e", **above, rollout__weights_version={1: 0.0, 2: 1.0}), "r")
    # the same values pass the FP8 KV cache's wider bound; ages shift the expected version
    check_refits_and_mismatch(_History("fp8-e2e-kvfp8", **above, rollout__weights_version={1: 0.0, 2: 0.0}), "r",
                              ages={2: 1})
