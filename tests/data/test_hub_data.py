"""Data keys naming a hub dataset ``ORG/NAME``: one split of one subset read from a Hugging Face cache in the hub's
layout (offline); a missing subset, split or column fails in one line naming its key."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hub import add_dataset  # noqa: E402

from configs.schema import config_from_dict  # noqa: E402
from data.loading import DataError, PromptSource  # noqa: E402


def _rows(tag: str, n: int, q: str = "question", a: str = "answer") -> list[dict]:
    return [{q: f"{tag} {i} + 1?", a: str(i + 1)} for i in range(n)]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    add_dataset(cache, "acme/math", {"main": {"train": _rows("main-train", 6), "test": _rows("main-test", 3)},
                                     "hard": {"train": _rows("hard-train", 2), "test": _rows("hard-test", 2)}})
    add_dataset(cache, "acme/plain", {None: {"train": _rows("plain-train", 5), "validation": _rows("plain-val", 4)}})
    add_dataset(cache, "acme/omi", {None: {"train": _rows("omi", 3, "problem", "expected_answer"),
                                           "validation": _rows("omi-val", 2, "problem", "expected_answer")}})
    return cache


def _source(**data) -> PromptSource:
    cfg = config_from_dict({"data": data})
    return PromptSource.from_config(cfg.data, train_path=cfg.data.train_path, validation_path=cfg.data.validation_path,
                                    seed=0)


def test_a_hub_dataset_loads_one_split_of_one_subset(hub):
    src = _source(train_path="acme/math", validation_path="acme/math", subset="hard", validation_split="test")
    assert len(src.train) == 2 and len(src.validation) == 2
    assert src.validation_rows(10)[0] == {"id": 0, "question": "hard-test 0 + 1?", "answer": "1", "task": "addition"}
    assert {r["question"].split()[0] for r in src.train_rows(0, 4)} == {"hard-train"}
    # the plain layout (one subset, splits from the file names), also with other column names
    plain = _source(train_path="acme/plain", validation_path="acme/plain")
    assert (len(plain.train), len(plain.validation)) == (5, 4)
    omi = _source(train_path="acme/omi", validation_path="acme/omi", question_key="problem",
                  answer_key="expected_answer")
    assert omi.train_rows(0, 1)[0]["question"].startswith("omi ")


def test_a_hub_dataset_at_a_pinned_revision(hub):
    rev = (hub / "datasets--acme--plain" / "refs" / "main").read_text()
    src = _source(train_path=f"acme/plain@{rev}", validation_path="acme/plain")
    assert len(src.train) == 5


@pytest.mark.parametrize("data, starts", [
    ({"subset": "nope"}, "data.subset: 'nope' is not a subset of acme/math (subsets: ['main', 'hard'])"),
    ({}, "data.subset: acme/math has several subsets, name one: ['main', 'hard']"),
    ({"subset": "main"}, "data.validation_split: 'validation' is not a split of acme/math subset main (splits: "
                         "['train', 'test'])"),
    ({"subset": "main", "train_split": "dev", "validation_split": "test"}, "data.train_split: 'dev' is not a split"),
    ({"subset": "main", "validation_split": "test", "answer_key": "solution"},
     "acme/math (subset main, split train): no answer column 'solution' (set data.answer_key); columns present: "
     "['question', 'answer']"),
])
def test_bad_subset_split_or_column_is_named_in_one_line(hub, data, starts):
    with pytest.raises(DataError) as e:
        _source(train_path="acme/math", validation_path="acme/math", **data)
    assert str(e.value).startswith(starts) and "\n" not in str(e.value), str(e.value)
