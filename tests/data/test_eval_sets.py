"""evaluation.sets: the embedded harder addition set, user files in GSM8K layout, errors that name the key, and the
per-set validation metrics (Wilson CI, unbiased pass@k / avg@k, the TEST-ONLY fault)."""
import json

import pytest

from configs.schema import ConfigError, load_config
from data.eval_sets import check_eval_paths, embedded_set_path, ensure_embedded_set, load_eval_sets
from data.loading import DataError
from rewards.addition_task import verify

RECIPE = "configs/tiny_bf16.yaml"


def _cfg(tmp_path, *sets, extra=()):
    items = ", ".join("{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in s.items()) + "}" for s in sets)
    return load_config(RECIPE, [f"evaluation.sets=[{items}]", f"bootstrap.assets_dir={tmp_path / 'assets'}", *extra])


def test_embedded_digits_set_is_deterministic_and_disjoint_from_training(tmp_path):
    data = tmp_path / "assets" / "addition" / "data"
    data.mkdir(parents=True)
    # an SFT file holding 4-digit pairs: none of them may come back as an evaluation prompt
    first = ensure_embedded_set(tmp_path / "other", 4, rows_count=50)
    taken = [json.loads(line) for line in first.read_text().splitlines()[:20]]
    (data / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in taken))
    path = ensure_embedded_set(tmp_path / "assets", 4, rows_count=50)
    assert path == embedded_set_path(tmp_path / "assets", 4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50
    qs = {r["question"] for r in rows}
    assert not qs & {r["question"] for r in taken}
    for r in rows:
        a, b = (int(x) for x in r["question"].rstrip("?.").replace(",", "").split() if x.isdigit())
        assert 1000 <= a <= 9999 and 1000 <= b <= 9999 and int(r["answer"]) == a + b
        assert verify(r["solution"], r["answer"]) == (True, True)  # clean scratchpads
    again = ensure_embedded_set(tmp_path / "assets", 4, rows_count=50)
    assert again.read_text() == path.read_text()  # cached, unchanged
    fresh = ensure_embedded_set(tmp_path / "fresh", 4, rows_count=50)
    assert fresh.read_text().splitlines()[:20] == first.read_text().splitlines()[:20]  # same seed, same rows


def test_load_sets_embedded_and_gsm8k_file(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"q": f"Tom has {i} apples and buys 2. How many?", "a": f"... #### {i + 2}"})
                           + "\n" for i in range(7)))
    cfg = _cfg(tmp_path, {"name": "digits5", "path": "embedded:digits5", "max_samples": 30},
               {"name": "gsm", "path": str(gsm), "task": "arithmetic", "question_key": "q", "answer_key": "a",
                "when": "period"})
    check_eval_paths(cfg)
    sets = load_eval_sets(cfg)
    assert list(sets) == ["digits5", "gsm"]
    assert len(sets["digits5"]) == 30 and len(sets["gsm"]) == 7  # max_samples caps, a short file gives all rows
    assert [r["id"] for r in sets["gsm"]] == list(range(7))
    assert {r["task"] for r in sets["digits5"]} == {"addition"} and sets["gsm"][0]["task"] == "arithmetic"
    assert sets["gsm"][3]["answer"].endswith("#### 5")
    capped = load_eval_sets(_cfg(tmp_path, {"name": "digits5", "path": "embedded:digits5", "max_samples": 30},
                                 extra=["grpo.max_val_samples=12"]))
    assert len(capped["digits5"]) == 12 and capped["digits5"] == sets["digits5"][:12]  # grpo.max_val_samples caps


def test_bad_sets_fail_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^evaluation\.sets\[0\]\.path: .*no such file"):
        check_eval_paths(_cfg(tmp_path, {"name": "x", "path": str(tmp_path / "missing.jsonl")}))
    bad = tmp_path / "cols.jsonl"
    bad.write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    cfg = _cfg(tmp_path, {"name": "ok", "path": "embedded:digits4", "max_samples": 5},
               {"name": "cols", "path": str(bad), "question_key": "problem"})
    with pytest.raises(DataError, match=r"^evaluation\.sets\[1\]\.path: .*cols\.jsonl:1: no answer key 'answer' "
                                        r"\(set evaluation\.sets\[1\]\.answer_key\)"):
        load_eval_sets(cfg)
    for sets, key in [([{"name": "main", "path": "a.jsonl"}], "evaluation.sets[0].name"),
                      ([{"name": "a b", "path": "a.jsonl"}], "evaluation.sets[0].name"),
                      ([{"name": "x", "path": "embedded:digits99"}], "evaluation.sets[0].path"),
                      ([{"name": "x", "path": "embedded:digits4", "task": "arithmetic"}], "evaluation.sets[0].path"),
                      ([{"name": "x", "path": "a.txt"}], "evaluation.sets[0].path"),
                      ([{"name": "x", "path": "a.jsonl", "max_samples": 0}], "evaluation.sets[0].max_samples"),
                      ([{"name": "x", "path": "a.jsonl", "when": "sometimes"}], "evaluation.sets[0].when")]:
        with pytest.raises(ConfigError) as e:
            _cfg(tmp_path, *sets)
        assert str(e.value).startswith(key + ":"), str(e.value)
    for override, key in [("evaluation.pass_k=[1,16]", "evaluation.pass_k"),
                          ("evaluation.num_samples=-1", "evaluation.num_samples"),
                          ("evaluation.bootstrap_samples=10", "evaluation.bootstrap_samples"),
                          ("evaluation.sampled_sets=[main,nope]", "evaluation.sampled_sets[1]"),
                          ("testing.fault_val_accuracy_drop=1.5", "testing.fault_val_accuracy_drop")]:
        with pytest.raises(ConfigError) as e:
            load_config(RECIPE, ["evaluation.num_samples=8", override])
        assert str(e.value).startswith(key + ":"), str(e.value)


def test_set_metrics_and_fault():
    from process.faults import TestHooks
    from tasks.context import EvalParams
    from tasks.rl import _set_metrics

    ev = EvalParams(n=4, ks=(1, 4), max_prompts=2, n_boot=500, sets=("x",))
    recs = [{"correct": True, "format_valid": True, "response_tokens": 10, "samples_correct": [1, 0, 0, 0],
             "samples_format_valid": [1, 1, 1, 1]},
            {"correct": False, "format_valid": True, "response_tokens": 20, "samples_correct": [1, 1, 0, 0],
             "samples_format_valid": [1, 1, 0, 1]},
            {"correct": False, "format_valid": False, "response_tokens": 30}]  # not in the sampled subset
    m = _set_metrics("val/x/", recs, ev, sampled=True)
    assert m["val/x/accuracy"] == pytest.approx(1 / 3) and m["val/x/num_prompts"] == 3
    assert m["val/x/accuracy_lo"] == pytest.approx(0.0615, abs=1e-3)  # Wilson 1/3
    assert m["val/x/accuracy_hi"] == pytest.approx(0.7923, abs=1e-3)
    assert m["val/x/format_valid"] == pytest.approx(2 / 3) and m["val/x/response_length_mean"] == 20
    assert m["val/x/pass_at_4"] == 1.0 and m["val/x/avg_at_4"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["val/x/pass_at_1"] == pytest.approx(m["val/x/avg_at_1"])
    assert m["val/x/sampled_prompts"] == 2 and m["val/x/sampled_format_valid"] == pytest.approx(7 / 8)
    assert "val/x/pass_at_4" not in _set_metrics("val/x/", recs, ev, sampled=False)
    correct = [True] * 40 + [False] * 60
    hooks = TestHooks(val_accuracy_drop=0.05)
    flipped = hooks.degraded(correct, seed=3)
    assert len(flipped) == 5 and all(correct[i] for i in flipped)  # exactly 5 points of 100, only correct ones
    assert hooks.degraded(correct, seed=3) == flipped
