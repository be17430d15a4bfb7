"""The addition task: scratchpad worked examples, generator properties, the strict verifier and the task dispatch."""
import json
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import addition_task as at
from rewards.verifiers import verify


def test_scratchpad_worked_examples():
    assert at.scratchpad(4721, 398) == "1+8+0=9 2+9+0=11 7+3+1=11 4+0+1=5 The answer is \\boxed{5119}."
    assert at.scratchpad(95, 7) == "5+7+0=12 9+0+1=10 The answer is \\boxed{102}."  # last sum written in full
    assert at.scratchpad(10, 20) == "0+0+0=0 1+2+0=3 The answer is \\boxed{30}."


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_scratchpad_answer_is_the_sum_and_columns_are_consistent(a, b):
    text = at.scratchpad(a, b)
    assert at.final_answer(text) == str(a + b)
    carry = 0
    cols = re.findall(r"(\d)\+(\d)\+(\d)=(\d+)", text)
    assert len(cols) == max(len(str(a)), len(str(b)))
    for x, y, c, s in cols:
        assert int(c) == carry and int(x) + int(y) + int(c) == int(s)
        carry = int(s) // 10


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("1+8+0=9 The answer is \\boxed{5119}.", "5119", (True, True)),
        ("The answer is \\boxed{5119}", "5119", (True, True)),  # final period optional
        ("\\boxed{5119}.  ", "#### 5,119", (True, True)),  # GSM8K-style gold
        ("The answer is \\boxed{5118}.", "5119", (True, False)),  # well-formed, wrong
        ("The answer is 5119.", "5119", (False, False)),  # no box: not format-valid, not correct
        ("\\boxed{5119} and more text", "5119", (False, False)),  # box not at the end
        ("\\boxed{1} The answer is \\boxed{5119}.", "5119", (False, False)),  # two boxes
        ("The answer is \\boxed{51 19}.", "5119", (False, False)),
        ("The answer is \\boxed{-5119}.", "5119", (False, False)),
        ("The answer is \\boxed{5119", "5119", (False, False)),  # cut off
    ],
)
def test_verifier_worked_examples(response, answer, expected):
    assert at.verify(response, answer) == expected
    assert verify("addition", response, answer) == expected
    assert at.reward(response, answer) == (1.0 if expected[1] else 0.0)


def test_arithmetic_dispatch_keeps_its_verifier():
    assert verify("arithmetic", "no box, but 19 at the end", "19") == (False, True)  # last-number fallback
    assert verify("arithmetic", "12 + 7 = 19. The answer is \\boxed{19}.", "19") == (True, True)
    with pytest.raises(ValueError, match="data.task"):
        verify("nope", "x", "1")


def test_make_problem_digit_ranges():
    rng = random.Random(0)
    spec = at.AdditionSpec(min_digits=3, max_digits=3)
    for _ in range(200):
        row = at.make_problem(rng, spec)
        a, b = (int(v) for v in re.findall(r"\d+", row["question"]))
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["answer"] == str(a + b)
        assert at.verify(row["solution"], row["answer"]) == (True, True)
    with pytest.raises(ValueError):
        at.AdditionSpec(min_digits=3, max_digits=2)


def test_splits_disjoint_and_deterministic(tmp_path):
    paths = at.generate_splits(tmp_path / "a", n_train=300, n_validation=50, seed=1)
    again = at.generate_splits(tmp_path / "b", n_train=300, n_validation=50, seed=1)
    assert paths["train"].read_text() == again["train"].read_text()

    def pairs(p):
        out = set()
        for line in p.read_text().splitlines():
            a, b = (int(v) for v in re.findall(r"\d+", json.loads(line)["question"]))
            out.add((min(a, b), max(a, b)))
        return out

    train, val = pairs(paths["train"]), pairs(paths["validation"])
    assert len(train) == 300 and len(val) == 50 and not train & val


def test_noisy_teacher_forgets_carries_consistently():
    # 95 + 7 with the carry into column 1 forgotten: 5+7+0=12, 9+0+0=9 -> the teacher boxes 92 (true sum 102).
    assert at.scratchpad(95, 7, forget=lambda i: True) == "5+7+0=12 9+0+0=9 The answer is \\boxed{92}."
    assert at.scratchpad(12, 34, forget=lambda i: True) == at.scratchpad(12, 34)  # no carry: nothing to forget
    rng = random.Random(0)
    spec = at.AdditionSpec(carry_drop=1.0)
    rows = [at.make_problem(rng, spec, teacher=True) for _ in range(300)]
    wrong = [r for r in rows if at.verify(r["solution"], r["answer"]) != (True, True)]
    with_carry = [r for r in rows if "+1=" in at.scratchpad(*(int(v) for v in re.findall(r"\d+", r["question"])))]
    assert len(wrong) == len(with_carry) > 100  # every demonstration with a carry is wrong, the others right
    clean = [at.make_problem(rng, spec) for _ in range(100)]  # validation / reference solutions stay clean
    assert all(at.verify(r["solution"], r["answer"]) == (True, True) for r in clean)


def test_splits_teacher_noise_only_in_train(tmp_path):
    paths = at.generate_splits(tmp_path, n_train=400, n_validation=100, spec=at.AdditionSpec(carry_drop=0.5))
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    assert all(at.verify(r["solution"], r["answer"])[1] for r in rows["validation"])
    frac_wrong = sum(not at.verify(r["solution"], r["answer"])[1] for r in rows["train"]) / 400
    assert 0.2 < frac_wrong < 0.6


def test_sft_split_longer_operands_and_no_shared_pairs(tmp_path):
    paths = at.generate_splits(tmp_path, n_train=200, n_validation=50, seed=1, spec=at.AdditionSpec(2, 3),
                               n_sft=300, sft_spec=at.AdditionSpec(2, 4, carry_drop=0.6))
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    pairs = {k: {at._pair(r) for r in v} for k, v in rows.items()}
    assert [len(pairs[k]) for k in ("validation", "train", "sft")] == [50, 200, 300]
    assert not (pairs["validation"] & pairs["train"] or pairs["validation"] & pairs["sft"] or pairs["train"] & pairs["sft"])
    assert max(max(p) for p in pairs["train"] | pairs["validation"]) < 1000
    assert max(max(p) for p in pairs["sft"]) >= 1000  # the SFT saw 4-digit operands too
