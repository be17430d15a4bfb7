"""The embedded task's generator and verifier: worked examples, GSM8K / boxed / comma formats, split hygiene."""
import json
import random

import pytest

from rewards.math_task import extract_answer, generate_splits, make_problem, reference_answer, reward


def is_correct(response: str, answer: str) -> bool:
    """The response's final answer equals the gold answer (a full reward)."""
    return reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("12 + 7 = 19. The answer is \\boxed{19}.", "19", True),
        ("12 + 7 = 19. The answer is \\boxed{18}.", "19", False),
        ("\\boxed{3} then \\boxed{19}", "19", True),  # the last box counts
        ("no box, but 19 at the end", "19", True),  # falls back to the last number
        ("nothing numeric", "19", False),
        ("\\boxed{1,234}", "#### 1,234", True),  # GSM8K gold format, thousands separators
        ("\\boxed{42.0}", "42", True),
        ("\\boxed{-5}", "-5", True),
        ("\\boxed{5}", "-5", False),
        ("\\boxed{\\frac{1}{2}}", "1/2", True),  # non-numeric gold: math-verify
        ("\\boxed{1/3}", "\\frac{1}{2}", False),
    ],
)
def test_verifier_worked_examples(response, answer, expected):
    assert is_correct(response, answer) is expected
    assert reward(response, answer) == (1.0 if expected else 0.0)


def test_extract_and_reference():
    assert extract_answer("so \\boxed{ 68 }.") == "68"
    assert extract_answer("") is None
    assert reference_answer("Janet has ... #### 72") == "72"


def test_generated_problems_are_self_consistent():
    rng = random.Random(3)
    for _ in range(500):
        row = make_problem(rng)
        assert is_correct(row["solution"], row["answer"])
        assert int(row["answer"]) >= 0


def test_splits_are_disjoint_and_deterministic(tmp_path):
    a = generate_splits(tmp_path / "a", n_train=300, n_validation=50, seed=1)
    b = generate_splits(tmp_path / "b", n_train=300, n_validation=50, seed=1)
    assert a["train"].read_text() == b["train"].read_text()
    train = {json.loads(line)["question"] for line in a["train"].read_text().splitlines()}
    val = [json.loads(line) for line in a["validation"].read_text().splitlines()]
    assert len(val) == 50 and len(train) == 300
    assert not train & {r["question"] for r in val}
