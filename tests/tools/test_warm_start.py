"""tools.warm_start: teacher-forced carry probabilities land on the carry tokens of the clean scratchpad."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_carry_probabilities_count_and_range(tmp_path):
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedded.tiny_model import TinyModelSpec, build_tiny_model
    from rewards.addition_task import make_problem
    from tools.warm_start import carry_probabilities

    d = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                         TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))
    tok, model = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d).eval()
    rows = [make_problem(random.Random(i)) for i in range(6)]
    rows.append({"question": "What is 879 + 583?", "answer": "1462",
                 "solution": "9+3+0=12 7+8+1=16 8+5+1=14 The answer is \\boxed{1462}."})
    p = carry_probabilities(model, tok, rows)
    carries = sum(r["solution"].count("+1=") for r in rows)
    columns = sum(r["solution"].count("=") for r in rows)
    assert len(p["carry_1"]) == carries >= 2 and len(p["carry_0"]) == columns - carries
    assert len(p["sum"]) == columns
    assert all(0.0 < x <= 1.0 for v in p.values() for x in v)
