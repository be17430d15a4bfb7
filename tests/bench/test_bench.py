"""bench: the table computes its ratios (P1, P3, throughput shares) from the measured times; the numerics sections
run; the workload picks the flow's prompts (same selection rule as data.loading.PromptSource)."""
import pytest

import bench.__main__ as B
from bench.workload import Workload, step_rows


def _res():
    med = lambda step, refit: {"step_s": step, "refit_s": refit, "rollout_s": 1.0, "old_logprob_s": 0.5,  # noqa: E731
                               "train_fwd_bwd_s": 2.0, "optimizer_s": 0.1, "reward_s": 0.01}
    return {"trl": {"median_step_s": 4.0},
            "steps": {"bf16": {"median": med(3.0, 0.03), "bf16_mode": "emulated"},
                      "fp8": {"median": med(3.6, 0.06), "bf16_mode": "emulated"},
                      "bf16_native": {"median": med(2.4, 0.03), "bf16_mode": "native"}},
            "quantize": {"copy": 10.0, "tensorwise": 2.5, "rowwise": 2.0, "group128": 3.0, "block128": 1.0},
            "linear": [{"shape": "8x8->8", "fp32_ms": 1.0, "bf16_native_ms": 0.8, "bf16_autocast/fp32": 9.0,
                        "bf16_emulated/fp32": 1.1, "fp8_blockwise/fp32": 1.2, "fp8_rowwise/fp32": 1.4,
                        "fp8_tensorwise/fp32": 1.3, "fp8_blockwise/bf16": 1.5, "fp8_rowwise/bf16": 1.75,
                        "fp8_tensorwise/bf16": 1.625}]}


def test_table_ratios():
    t = B.table(_res())
    assert "| P1 bf16: project step / TRL step | 0.75 |" in t
    assert "| P1 fp8: project step / TRL step | 0.90 |" in t
    assert "| P3: FP8 step / BF16 step | 1.20 | <= 1.15 |" in t
    assert "| project step bf16_native (s; BF16 reference, native BF16 trainer) | 2.40 |" in t
    assert "| FP8 step / BF16 step with a native BF16 trainer | 1.50 |" in t
    assert "| refit share of the fp8 step | 1.7% |" in t
    assert "quantize tensorwise: GB/s / copy GB/s (2.50 / 10.00) | 25% |" in t
    assert "FP8 (worst recipe) / native BF16 linear (BF16 0.8 ms, FP32 1.0 ms) | 1.75 |" in t
    without_trl = B.table({**_res(), "trl": None})
    assert "| P1 bf16: project step / TRL step | n/a |" in without_trl
    assert "not measured (--flow-steps 0)" in t
    flow = {"steps": 4, "step_s": 2.0, "share_orchestration": 0.031, "share_refit_kv": 0.012, "workers_up_s": 9.5,
            "time_to_first_step_s": 21.25}
    with_flow = B.table({**_res(), "flow": flow, "load_average_start": 0.5, "load_average_end": 1.25})
    assert "| orchestration share of the FP8 flow step (Prefect/Ray/MLflow; step 2.00 s, median of steps 2..4) | " \
           "3.1% | <= 5% |" in with_flow
    assert "| refit + KV calibration share of the FP8 flow step | 1.2% | <= 3% |" in with_flow
    assert "workers up 9.5 s) | 21.2 s |" in with_flow and "| 0.5 / 1.2 |" in with_flow
    assert "MXFP8" not in t  # its side runs with --mxfp8 only
    mx = _res()
    mx["steps"]["mxfp8"] = {"median": {**mx["steps"]["fp8"]["median"], "step_s": 4.5}, "bf16_mode": "emulated"}
    assert "| MXFP8 step (1x32 groups, E8M0 scales) / FP8 blockwise step | 1.25 | |" in B.table(mx)


def test_results_file(tmp_path):
    """What ``python -m bench`` writes when it finishes: the stamped results file with the table."""
    from tools.results import stamp

    origin = stamp("bench", ["--skip-trl"])
    res = {**_res(), "torch": "2.x", "qdq_kernel": "fused", "mlflow_run_id": "r1", "steps_per_side": 4,
           "workload": {"model_dir": str(tmp_path / "m"), "num_prompts": 16, "num_generations": 8,
                        "max_new_tokens": 32}}
    res["table"] = B.table(res)
    text = B.write_results_doc(res, origin, tmp_path / "bench.md").read_text()
    assert text.startswith("# Bench: results\n\nWritten by `") and "-m bench`; the next run" in text
    assert f"- command: `{origin['command']}`" in text and f"- commit: `{origin['commit']}`" in text
    assert "- torch 2.x; quantize: fused" in text and "16 prompts x 8 samples x <= 32 tokens; 4 steps" in text
    assert "MLflow run `r1`" in text and "| P3: FP8 step / BF16 step | 1.20 |" in text


def test_numerics_sections_run():
    q = B.bench_quantize((64, 256), reps=1)
    assert set(q) == {"copy", "tensorwise", "rowwise", "group128", "group32", "block128"} and min(q.values()) > 0
    (lin,) = B.bench_linear([(64, 128, 128)], reps=1)
    assert lin["shape"] == "64x128->128" and lin["fp8_blockwise/fp32"] > 0 and lin["bf16_emulated/fp32"] > 0
    assert lin["fp8_blockwise/bf16"] > 0 and lin["bf16_native_ms"] > 0


def test_workload_rows_follow_the_flow(tmp_path):
    from data.loading import PromptSource, load_split
    from rewards.math_task import generate_splits

    splits = generate_splits(tmp_path, n_train=50, n_validation=5)
    w = Workload(model_dir="unused", train_path=str(splits["train"]), num_prompts=4)
    assert Workload.from_json(w.to_json()) == w
    src = PromptSource(load_split(str(splits["train"])), None, question_key="question", answer_key="answer", seed=0)
    for step in (0, 3):
        flow = [(r["question"], r["answer"]) for r in src.train_rows(step, 4)]
        assert [(r["question"], r["answer"]) for r in step_rows(w, step)] == flow


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flow_run_reads_orchestration_shares_from_a_real_flow():
    """bench.flow_run runs python -m flows.grpo (Prefect + Ray + MLflow) for 2 steps and reads the shares back (a
    quarter of the bench's batch: the reading-back is tested here, the bench itself measures the full workload)."""
    from dataclasses import replace

    from bench.flow_run import run_flow
    from bench.workload import default_workload

    w = replace(default_workload(quick=True), num_prompts=4, num_generations=4, global_batch=16, micro_batch=16)
    r = run_flow("configs/tiny_fp8_e2e.yaml", w, steps=2)
    assert 0.0 <= r["share_orchestration"] < 1.0 and 0.0 < r["share_refit_kv"] < 1.0
    assert r["step_s"] > 0 and r["workers_up_s"] > 0 and 0 < r["time_to_first_step_s"] < r["wall_s"]
