"""Dataset loading: jsonl/parquet from paths, file:// and s3:// (moto), configurable columns, clear errors."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from data import loading
from data.loading import DataError, PromptSource, check_local_files, load_split, step_indices

ROWS = [{"problem": f"What is {i} plus 1?", "expected_answer": str(i + 1)} for i in range(10)]


def _write(tmp_path: Path, rows=ROWS) -> tuple[Path, Path]:
    import pandas as pd

    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(pq)
    return jl, pq


def test_local_jsonl_parquet_and_file_url(tmp_path):
    jl, pq = _write(tmp_path)
    for path in (str(jl), f"file://{jl}", str(pq), f"file://{pq}"):
        ds = load_split(path, question_key="problem", answer_key="expected_answer")
        assert len(ds) == 10 and ds[3]["expected_answer"] == "4", path


def test_errors_name_file_and_column(tmp_path):
    jl, pq = _write(tmp_path)
    with pytest.raises(DataError, match=r"missing\.jsonl: dataset file not found"):
        load_split(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"d\.jsonl:1: no answer key 'answer' \(set data\.answer_key\); keys on this "
                                        r"line: \['expected_answer', 'problem'\]$"):
        load_split(str(jl), question_key="problem", answer_key="answer")
    with pytest.raises(DataError, match=r"d\.jsonl:1: no question key 'question'"):
        load_split(str(jl), answer_key="expected_answer")
    with pytest.raises(DataError, match=r"d\.parquet: no answer column 'answer' \(set data\.answer_key\).*expected_answer"):
        load_split(str(pq), question_key="problem", answer_key="answer")
    with pytest.raises(DataError, match=r"d\.csv: unknown dataset format"):
        load_split(str(tmp_path / "d.csv"))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as parquet"):
        load_split(str(bad))


@pytest.mark.parametrize("line, needle", [
    ('{"problem": "What is 4 plus 1?", "expected_answer": "5"', "not valid JSON: Expecting ',' delimiter (column 56)"),
    ('["What is 4 plus 1?", "5"]', "not a JSON object (a list); each line must be one row"),
    ('{"problem": "What is 4 plus 1?"}', "no answer key 'expected_answer' (set data.answer_key); keys on this line: "
                                         "['problem']"),
    ('{"problem": "What is 4 plus 1?", "expected_answer": null}', "answer key 'expected_answer' is null"),
    ('{"problem": "What is 4 plus 1?", "expected_answer": ["5"]}',
     "answer key 'expected_answer' is a list ([\"5\"]); expected text or a number"),
    ('{"problem": {"text": "What is 4 plus 1?"}, "expected_answer": "5"}',
     "question key 'problem' is an object ({\"text\": \"What is 4 plus 1?\"}); expected text or a number"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line_number(tmp_path, line, needle):
    """One bad line among good ones (a blank line before it counts): the error is ``<file>:<line>: <what>``, for
    local paths and file:// URLs alike."""
    lines = [json.dumps(r) for r in ROWS]
    lines[3], lines[4] = "", line  # line 5 of the file
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for name in (str(path), f"file://{path}"):
        with pytest.raises(DataError) as e:
            load_split(name, question_key="problem", answer_key="expected_answer")
        assert str(e.value) == f"{name}:5: {needle}"


class _Keys:
    question_key, answer_key = "problem", "expected_answer"


def test_the_command_lines_check_gives_the_loaders_errors_within_its_prefix(tmp_path, monkeypatch):
    """check_local_files (run by ``python -m flows.grpo`` before Prefect starts) raises what load_split raises for a
    missing file, an unknown format and a bad line in the scanned prefix; a bad line past the prefix, hub ids,
    s3:// and ``embedded`` are left to the loader (which still names the line)."""
    lines = [json.dumps(r) for r in ROWS]
    lines[6] = '{"problem": "What is 6 plus 1?"}'  # line 7
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    good, _ = _write(tmp_path)
    needle = "no answer key 'expected_answer' (set data.answer_key); keys on this line: ['problem']"
    with pytest.raises(DataError) as e:
        check_local_files(_Keys, {"data.train_path": str(good), "data.validation_path": f"file://{path}"})
    assert str(e.value) == f"file://{path}:7: {needle}"
    for missing, what in ((tmp_path / "no.jsonl", "dataset file not found"), (tmp_path / "d.csv", "unknown dataset")):
        with pytest.raises(DataError, match=what):
            check_local_files(_Keys, {"data.train_path": str(missing)})
    check_local_files(_Keys, {"a": str(good), "b": "embedded", "c": "s3://bucket/x.jsonl", "d": "org/name"})
    start_of_line_7 = len("".join(line + "\n" for line in lines[:6]))
    monkeypatch.setattr(loading, "PREFLIGHT_SCAN_BYTES", start_of_line_7)  # line 7 starts right at the bound
    check_local_files(_Keys, {"data.train_path": str(path)})
    with pytest.raises(DataError) as e:
        load_split(str(path), question_key="problem", answer_key="expected_answer")
    assert str(e.value) == f"{path}:7: {needle}"
    monkeypatch.setattr(loading, "PREFLIGHT_SCAN_BYTES", start_of_line_7 + 1)
    with pytest.raises(DataError, match=":7: no answer key"):
        check_local_files(_Keys, {"data.train_path": str(path)})


def test_bad_bytes_json_document_and_parquet_nulls_are_located(tmp_path):
    import pandas as pd

    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"raw\.jsonl:2: not UTF-8 text"):
        load_split(str(raw), question_key="problem", answer_key="expected_answer")
    doc = tmp_path / "doc.json"  # one JSON document, not JSON lines: its parse error's line
    doc.write_text("[" + json.dumps(ROWS[0]) + ",\n" + json.dumps(ROWS[1])[:-1] + "\n]")
    with pytest.raises(DataError, match=r"doc\.json:3: not valid JSON"):
        load_split(str(doc), question_key="problem", answer_key="expected_answer")
    pq = tmp_path / "nulls.parquet"
    pd.DataFrame({"question": ["a", "b", None], "answer": ["1", "2", "3"]}).to_parquet(pq)
    with pytest.raises(DataError, match=r"nulls\.parquet: row 2: question column 'question' is null \(1 null rows\)"):
        load_split(str(pq))


def test_step_indices_deterministic_and_resumable():
    a = np.concatenate([step_indices(10, step=s, num_prompts=4, seed=3) for s in range(5)])
    # 20 draws over 10 rows: each epoch is a permutation, so each row appears exactly twice.
    assert sorted(np.bincount(a, minlength=10).tolist()) == [2] * 10
    assert np.array_equal(step_indices(10, step=3, num_prompts=4, seed=3), a[12:16])  # resume at step 3
    assert not np.array_equal(step_indices(10, step=0, num_prompts=4, seed=4), a[:4])
    assert step_indices(10, step=1, num_prompts=3, seed=0, shuffle=False).tolist() == [3, 4, 5]


def test_prompt_source_rows(tmp_path):
    jl, pq = _write(tmp_path)
    kw = dict(question_key="problem", answer_key="expected_answer")
    src = PromptSource(load_split(str(jl), **kw), load_split(str(pq), **kw), seed=0, task="arithmetic", **kw)
    rows = src.train_rows(0, 4)
    assert len(rows) == 4 and set(rows[0]) == {"id", "question", "answer", "task"}
    assert rows[0]["task"] == "arithmetic"  # the verifier that scores them (data.task); GSM8K-style files
    assert all(r["question"] == ROWS[r["id"]]["problem"] for r in rows)  # id = the row's index in the file
    assert [r["answer"] for r in src.validation_rows(3)] == ["1", "2", "3"]
    assert [r["id"] for r in src.validation_rows(3)] == [0, 1, 2]
    add = PromptSource(src.train, src.validation, seed=0, task="addition", **kw)
    assert {r["task"] for r in add.train_rows(0, 4) + add.validation_rows(3)} == {"addition"}




@pytest.mark.e2e
def test_s3_jsonl_and_parquet(tmp_path, moto_s3):
    import s3fs

    jl, pq = _write(tmp_path)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto_s3})
    fs.mkdir("data-bucket")
    fs.put(str(jl), "data-bucket/math/train.jsonl")
    fs.put(str(pq), "data-bucket/math/validation.parquet")
    kw = dict(question_key="problem", answer_key="expected_answer")
    assert len(load_split("s3://data-bucket/math/train.jsonl", **kw)) == 10
    assert load_split("s3://data-bucket/math/validation.parquet", endpoint_url=moto_s3, **kw)[0]["problem"] == \
        "What is 0 plus 1?"
    with pytest.raises(DataError, match=r"s3://data-bucket/math/nope\.parquet: dataset file not found"):
        load_split("s3://data-bucket/math/nope.parquet", **kw)
    assert "AWS_ENDPOINT_URL_S3" in os.environ


def test_answers_that_are_all_lists_are_named_by_line_and_parquet_rows_by_row(tmp_path):
    """A file whose every answer is a list reads as a list column (no null, no parse error): still refused, naming
    the first line; in a parquet file, the first row."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": r["problem"], "answer": [r["expected_answer"]]}) + "\n"
                            for r in ROWS))
    with pytest.raises(DataError, match=r"train\.jsonl:1: answer key 'answer' is a list \(\[\"[^\"]+\"\]\); "
                                         r"expected text or a number$"):
        load_split(str(path))
    import datasets

    pq = tmp_path / "train.parquet"
    datasets.Dataset.from_dict({"question": ["a", "b"], "answer": ["1", "2"], "x": [1, 2]}).to_parquet(str(pq))
    assert len(load_split(str(pq))) == 2
    datasets.Dataset.from_dict({"question": ["a", "b"], "answer": [["1"], ["2"]]}).to_parquet(str(pq))
    with pytest.raises(DataError, match=r"train\.parquet: row 0: answer column 'answer' is a list \(\[\"1\"\]\)"):
        load_split(str(pq))
