"""The run's context: the TEST-ONLY hooks are handed in once (built by the flow), and only a faulted run's
validation records go through them; a real run's pass as they were scored."""
from configs.schema import load_config
from process.faults import TestHooks
from tasks.context import RunContext

RECORDS = [{"id": i, "correct": c} for i, c in enumerate([True] * 40 + [False] * 60)]


def _ctx(overrides, hooks):
    cfg = load_config("configs/tiny_fp8_e2e.yaml", overrides)
    return RunContext.from_config(cfg, policy="p", rollouts=("r",), run_id=None, tracking_uri=None, model_dir="m",
                                  checkpoint_uri=None, hooks=hooks)


def test_a_real_run_scores_validation_as_it_is():
    ctx = _ctx([], TestHooks.from_config(load_config("configs/tiny_fp8_e2e.yaml"), None))
    assert ctx.hooks is None and ctx.validation_records(RECORDS, 3) is RECORDS


def test_a_faulted_run_turns_exactly_the_hooks_share_wrong():
    overrides = ["testing.fault_val_accuracy_drop=0.05"]
    hooks = TestHooks.from_config(load_config("configs/tiny_fp8_e2e.yaml", overrides), None)
    ctx = _ctx(overrides, hooks)
    out = ctx.validation_records(RECORDS, 3)
    faulted = [r["id"] for r in out if r.get("fault")]
    assert ctx.hooks is hooks and faulted == sorted(hooks.degraded([r["correct"] for r in RECORDS], 3))
    assert len(faulted) == 5 and all(RECORDS[i]["correct"] and not out[i]["correct"] for i in faulted)
    assert sum(r["correct"] for r in out) == 35 and [r["id"] for r in out] == list(range(100))
