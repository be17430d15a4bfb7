"""The one-fact arithmetic task (``data.task: arithmetic``): synthetic word problems with one integer answer, and its
verifier -- also the verifier of GSM8K / OpenMathInstruct-2 files. All of it is :class:`ArithmeticTask`.

Rows use the GSM8K layout (``question``, ``answer`` where the answer may end in ``#### 42``); OpenMathInstruct-2 style
files (``problem`` / ``expected_answer``) work by naming the columns in the config (``data.question_key``,
``data.answer_key``).

The model answers in the form ``... = 68. The answer is \\boxed{68}.``; the verifier extracts the last ``\\boxed{}``
(or, failing that, the last number), normalizes it and compares numerically; ``math-verify`` is the fallback for
anything that is not a plain number (fractions, expressions). Format-valid = the response holds a ``\\boxed{}`` (a
correct answer found by the last-number fallback is correct but not format-valid).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

# Word-problem templates: (text, operation). {a}/{b} are the operands, {x}/{y} names and objects.
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lea", "Max", "Nia", "Omar", "Pia"]
_THINGS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cookies", "stickers"]
_TEMPLATES = [
    ("{x} has {a} {t}. {y} gives {x} {b} more. How many {t} does {x} have now?", "+"),
    ("{x} had {a} {t} and found {b} more. How many {t} does {x} have?", "+"),
    ("What is {a} plus {b}?", "+"),
    ("{x} has {a} {t} and gives {b} to {y}. How many {t} are left?", "-"),
    ("There are {a} {t}. {x} takes away {b}. How many remain?", "-"),
    ("What is {a} minus {b}?", "-"),
    ("{x} buys {a} bags with {b} {t} each. How many {t} in total?", "*"),
    ("What is {a} times {b}?", "*"),
]

SYSTEM_PROMPT = "Solve the problem. End with: The answer is \\boxed{N}."


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in order, with nested braces balanced (``\\boxed{\\frac{1}{2}}``)."""
    found, start = [], text.find("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth, j = 1, i
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:
            break  # unbalanced: the response was cut off inside the box
        found.append(text[i: j - 1])
        start = text.find("\\boxed{", j)
    return found


def normalize_number(text: str) -> str | None:
    """'1,234' → '1234', '42.0' → '42', ' $7 ' → '7'; None when no number is present."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def reference_answer(answer: str) -> str:
    """The gold answer of a row: GSM8K's '... #### 42' → '42'; a plain '42' stays '42'."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def extract_answer(response: str) -> str | None:
    """The model's final answer: the last \\boxed{...}, else the last number in the response."""
    boxed = boxed_contents(response)
    if not boxed:
        return normalize_number(response)
    candidate = boxed[-1].strip().strip("$").strip()
    return normalize_number(candidate) if _NUMBER.fullmatch(candidate.replace(",", "")) else (candidate or None)




class ArithmeticTask:
    """``data.task: arithmetic``: its data (``make_problem``, ``generate_splits``), its prompt (``system_prompt``) and
    its reward (``reward``; ``verify`` = (format-valid, correct) for the RL step and validation)."""

    name = "arithmetic"
    system_prompt = SYSTEM_PROMPT

    def make_problem(self, rng: random.Random, *, max_operand: int = 20) -> dict:
        """One problem: question text, integer answer (as a string) and a worked solution used by the SFT bootstrap.

        Operands of + and - lie in [1, max_operand]; products use factors 2..9 (sized so that a ~3M-parameter model
        gets a minority of answers right after a short SFT, leaving room for RL).
        """
        text, op = rng.choice(_TEMPLATES)
        if op == "*":
            a, b = rng.randint(2, 9), rng.randint(2, 9)
        else:
            a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
            if op == "-" and b > a:
                a, b = b, a
        x, y = rng.sample(_NAMES, 2)
        question = text.format(a=a, b=b, x=x, y=y, t=rng.choice(_THINGS))
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        solution = f"{a} {op} {b} = {value}. The answer is \\boxed{{{value}}}."
        return {"question": question, "answer": str(value), "solution": solution}

    def generate_splits(self, out_dir: str | Path, *, n_train: int = 4000, n_validation: int = 200, seed: int = 0,
                        max_operand: int = 20) -> dict[str, Path]:
        """Write ``train.jsonl`` and ``validation.jsonl`` (columns question / answer / solution) and return their
        paths. Validation questions never appear in train (deduplicated on the question text)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(seed)
        seen: set[str] = set()
        splits = {"validation": n_validation, "train": n_train}
        paths = {}
        for name, count in splits.items():
            rows = []
            while len(rows) < count:
                row = self.make_problem(rng, max_operand=max_operand)
                if row["question"] in seen:
                    continue
                seen.add(row["question"])
                rows.append(row)
            path = out / f"{name}.jsonl"
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(path)
            paths[name] = path
        return paths

    def format_valid(self, response: str) -> bool:
        """The response holds a ``\\boxed{}``."""
        return bool(boxed_contents(response))

    def reward(self, response: str, answer: str) -> float:
        """1.0 when the final answer (last ``\\boxed{}``, else the last number) equals the gold answer, else 0.0:
        numeric comparison after normalization; math-verify for non-numeric gold answers (fractions, expressions)."""
        gold = reference_answer(answer)
        pred = extract_answer(response)
        if pred is None:
            return 0.0
        gold_num = normalize_number(gold) if _NUMBER.fullmatch(gold.replace(",", "").strip()) else None
        if gold_num is not None:
            return 1.0 if pred == gold_num else 0.0
        import logging

        from math_verify import parse, verify  # only for non-numeric answers: sympy import is slow

        # Timeouts off: math-verify's are signal-based and fail outside the main thread (Ray actors, Prefect tasks).
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        correct = verify(parse(f"${gold}$", parsing_timeout=None), parse(f"${pred}$", parsing_timeout=None),
                         timeout_seconds=None)
        return 1.0 if correct else 0.0

    def verify(self, response: str, answer: str) -> tuple[bool, bool]:
        """(format_valid, correct); correct = a full reward."""
        return self.format_valid(response), self.reward(response, answer) == 1.0


TASK = ArithmeticTask()
# The module's functions, as before (callers and tests import them by name).
make_problem = TASK.make_problem
generate_splits = TASK.generate_splits
reward = TASK.reward
