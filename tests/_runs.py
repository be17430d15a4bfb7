"""What every end-to-end test checks of the runs it trains (loaded with ``sys.path`` as tests/_ops.py is): each step's
rollout ran on the weights that step's refit loaded -- the version the engines report (``rollout/weights_version``),
not the one the driver asked for -- and the train/rollout mismatch stayed within what the run's recipe measures.

Mismatch bounds (``MISMATCH_BOUND``, by the run's ``precision`` tag): set from the per-step
``mismatch/token_mult_prob_error`` of the end-to-end tests' own tiny runs and from ``python -m diagnostics.mismatch``
(docs/results/mismatch.md, 32 prompts x 4 samples of the 325-step warm start: BF16 1.0006, FP8 rollout 1.0019,
end-to-end FP8 1.0014, + FP8 KV 1.0071), with room for the noise of a tiny step's few tokens. Where these tests' own
runs were read out (AMD EPYC, avx512_bf16), the values are in the comments beside the bound; the whole suite passes
with these bounds natively and under FP8GRPO_CPU_CAP=avx2.
"""

from __future__ import annotations

from pathlib import Path

# The pipeline's own warm start (the addition task's default 325-step SFT, seed 0), shared by the test run: the
# learning tests and the nightly regression's start from it (the session fixture ``warm_start``, tests/conftest.py).
# Built once -- the tests that use it form one xdist group with the local-stack tests, so no worker waits on
# another's build -- and reused by later runs while its recipe holds.
WARM_START_DIR = Path(__file__).resolve().parents[1] / "runs" / "test-env" / "warm-start"

# precision tag (configs Config.precision_tag) -> the largest per-step token_mult_prob_error an end-to-end test
# accepts; any tag with the FP8 KV cache (``-kvfp8``): KV_FP8_BOUND
MISMATCH_BOUND = {
    "bf16": 1.01,  # BF16 engine / FP32 trainer
    "fp8-rollout": 1.02,  # FP8 engine / FP32 trainer
    "fp8-train": 1.02,  # BF16 engine / FP8 trainer
    "fp8-e2e": 1.02,  # FP8 linears on both sides: MoE with routing replay 1.0060, 1.0072 (tests/flows, 30-step SFT)
}
KV_FP8_BOUND = 1.05  # + the FP8 KV cache: 1.0196, 1.0184, 1.0145 (tests/flows/test_grpo_e2e.py, native KV)


def mismatch_bound(precision: str) -> float:
    return KV_FP8_BOUND if precision.endswith("-kvfp8") else MISMATCH_BOUND[precision]


def step_history(client, run_id: str, key: str) -> dict[int, float]:
    """``key``'s MLflow history of ``run_id`` as {step: value} (a step logged twice would show as one: the tests of
    resumed runs check that separately)."""
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def check_refits_and_mismatch(client, run_id: str, *, ages: dict[int, int] | None = None,
                              bound: float | None = None) -> dict:
    """Assert, for every step of ``run_id``: the engines generated its rollout with the policy of step
    ``step - 1 - age`` (``ages``: the asynchronous trajectory age per step, default 0), the policy step the refit
    recorded is ``step - 1``, and ``mismatch/token_mult_prob_error`` <= ``bound`` (default: the bound of the run's
    precision tag). Returns {"steps", "versions", "mismatch"} for further checks."""
    run = client.get_run(run_id)
    steps = sorted(step_history(client, run_id, "reward/mean"))
    assert steps, f"run {run_id} logged no step"
    versions = step_history(client, run_id, "rollout/weights_version")
    want = {s: float(s - 1 - (ages or {}).get(s, 0)) for s in steps}
    assert versions == want, f"engine weights per step {versions}, expected the policy of {want}"
    assert step_history(client, run_id, "refit/weights_version") == {s: float(s - 1) for s in steps}
    precision = run.data.tags.get("precision")
    limit = mismatch_bound(precision) if bound is None else bound
    mismatch = step_history(client, run_id, "mismatch/token_mult_prob_error")
    assert sorted(mismatch) == steps, mismatch
    worst = max(mismatch.values())
    assert 1.0 <= min(mismatch.values()) and worst <= limit, \
        f"token_mult_prob_error per step {mismatch} ({precision}): above {limit}"
    print(f"[{precision}] token_mult_prob_error per step: "
          + ", ".join(f"{s}: {v:.4f}" for s, v in sorted(mismatch.items())))
    return {"steps": steps, "versions": versions, "mismatch": mismatch}
