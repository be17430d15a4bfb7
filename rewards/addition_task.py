"""The embedded RL task (``data.task: addition``, the default): multi-digit addition written as a column-by-column
scratchpad, and its strict verifier. All of it is :class:`AdditionTask`.

Why this task (docs/embedded-workload.md): on the one-fact arithmetic task (rewards/math_task.py)
what GRPO reinforces on one prompt barely transfers to the next, so validation stays flat. Here every problem is
solved by the same procedure, executed token by token, right to left::

    question: What is 4721 + 398?
    solution: 1+8+0=9 2+9+0=11 7+3+1=11 4+0+1=5 The answer is \\boxed{5119}.

Each column is written ``x+y+c=s``: the two digits of that column (the shorter number padded with 0), the carry
``c`` from the previous column (0 for the first) and their sum ``s``. The answer is the last column's sum followed by
the units digit of every earlier sum, last column first. The skills are shared by all problems (find the column's
digits, add three digits, carry when the previous sum was >= 10, read the answer back in reverse order), so a
correction reinforced on one prompt helps on all of them; the number of columns sets the difficulty.

Reward and format (:meth:`AdditionTask.reward`, ``verify``): a response is *format-valid* when it ends with
``\\boxed{<digits>}`` (optionally followed by ``.``) and holds exactly one ``\\boxed{}``; it is *correct* (reward
1.0) when it is format-valid and the boxed integer equals the sum. The scratchpad is not graded (outcome reward
only); a gain that is only formatting shows as ``format_valid`` rising without ``accuracy``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from rewards.math_task import SYSTEM_PROMPT, boxed_contents, reference_answer

NAME = "addition"
_TEMPLATES = ["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "Find the sum of {a} and {b}."]
_FINAL = re.compile(r"\\boxed\{(\d+)\}\.?\s*$")


@dataclass(frozen=True)
class AdditionSpec:
    """Operands have ``min_digits``..``max_digits`` digits each (uniform, independently), leading digit non-zero.

    ``carry_drop``: the SFT teacher's slip rate. Each carry in a *training* demonstration is forgotten with this
    probability (the column is written ``x+y+0`` and the rest follows from it), so the warm-started policy mixes the
    right procedure with a systematic, shared mistake; rewards (always against the true sum) tell them apart.
    Validation solutions are always clean.
    """

    min_digits: int = 2
    max_digits: int = 4
    carry_drop: float = 0.0

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= 12:
            raise ValueError(f"addition: need 1 <= min_digits <= max_digits <= 12, got {self}")
        if not 0.0 <= self.carry_drop <= 1.0:
            raise ValueError(f"addition: carry_drop must be in [0, 1], got {self.carry_drop}")


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def scratchpad(a: int, b: int, *, forget=lambda column: False) -> str:
    """The column-by-column solution of ``a + b`` ending in ``The answer is \\boxed{...}.`` (see the module doc).

    ``forget(i)`` -> True makes the writer drop the carry into column ``i`` (it writes ``+0``), the way the noisy
    SFT teacher does; the rest of the scratchpad stays consistent with that slip, so the boxed answer is then wrong.
    """
    if a < 0 or b < 0:
        raise ValueError(f"scratchpad: non-negative operands only, got {a}, {b}")
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    carry, cols, sums = 0, [], []
    for i in range(width):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if carry and forget(i):
            carry = 0
        s = x + y + carry
        cols.append(f"{x}+{y}+{carry}={s}")
        sums.append(s)
        carry = s // 10
    answer = str(sums[-1]) + "".join(str(s % 10) for s in reversed(sums[:-1]))
    return " ".join(cols) + f" The answer is \\boxed{{{answer}}}."


def _pair(row: dict) -> tuple[int, int]:
    a, b = (int(v) for v in re.findall(r"\d+", row["question"]))
    return min(a, b), max(a, b)


def _write(path: Path, rows: list[dict]) -> Path:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def final_answer(response: str) -> str | None:
    """The boxed integer when the response is format-valid (exactly one ``\\boxed{digits}``, at the end), else None."""
    if len(boxed_contents(response)) != 1:
        return None
    m = _FINAL.search(response)
    return m.group(1) if m else None


class AdditionTask:
    """``data.task: addition`` (the default): its data (``make_problem``, ``generate_splits``), its prompt
    (``system_prompt``) and its reward (``reward``; ``verify`` = (format-valid, correct) for the RL step and
    validation)."""

    name = NAME
    system_prompt = SYSTEM_PROMPT  # the arithmetic task's: both tasks answer in the same \boxed{} form

    def make_problem(self, rng: random.Random, spec: AdditionSpec | None = None, *, teacher: bool = False) -> dict:
        """One problem: question, answer (the true sum, as a string) and a scratchpad solution: the noisy teacher's
        (``spec.carry_drop``) when ``teacher``, else the clean one."""
        spec = spec or AdditionSpec()
        a = _operand(rng, rng.randint(spec.min_digits, spec.max_digits))
        b = _operand(rng, rng.randint(spec.min_digits, spec.max_digits))
        question = rng.choice(_TEMPLATES).format(a=a, b=b)
        drop = spec.carry_drop if teacher else 0.0
        return {"question": question, "answer": str(a + b),
                "solution": scratchpad(a, b, forget=lambda i: rng.random() < drop)}

    def _rows(self, rng: random.Random, spec: AdditionSpec | None, count: int, *, teacher: bool,
              seen: set[tuple[int, int]]) -> list[dict]:
        """``count`` problems whose operand pairs (either order) are not in ``seen``; adds them to ``seen``."""
        rows = []
        while len(rows) < count:
            row = self.make_problem(rng, spec, teacher=teacher)
            if _pair(row) in seen:
                continue
            seen.add(_pair(row))
            rows.append(row)
        return rows

    def generate_splits(self, out_dir: str | Path, *, n_train: int = 20000, n_validation: int = 500, seed: int = 0,
                        spec: AdditionSpec | None = None, n_sft: int = 0, sft_spec: AdditionSpec | None = None
                        ) -> dict[str, Path]:
        """Write ``validation.jsonl`` and ``train.jsonl`` (question / answer / solution: clean in validation, the
        teacher's in train) from ``spec``, and with ``n_sft`` > 0 also ``sft.jsonl`` (the SFT warm start's rows, the
        teacher's solutions, from ``sft_spec``: its operands may be longer than the RL prompts'). No operand pair
        appears in two splits (in either order)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        rng = random.Random(seed)
        seen: set[tuple[int, int]] = set()
        paths = {"validation": _write(out / "validation.jsonl",
                                      self._rows(rng, spec, n_validation, teacher=False, seen=seen)),
                 "train": _write(out / "train.jsonl", self._rows(rng, spec, n_train, teacher=True, seen=seen))}
        if n_sft:
            paths["sft"] = _write(out / "sft.jsonl", self._rows(rng, sft_spec or spec, n_sft, teacher=True, seen=seen))
        return paths

    def format_valid(self, response: str) -> bool:
        """Exactly one ``\\boxed{digits}``, at the end of the response (optionally followed by ``.``)."""
        return final_answer(response) is not None

    def reward(self, response: str, answer: str) -> float:
        """1.0 for a format-valid response whose boxed integer equals the gold answer ('5119' or GSM8K-style
        '... #### 5119'), else 0.0. The scratchpad is not graded (outcome reward only)."""
        pred = final_answer(response)
        if pred is None:
            return 0.0
        gold = reference_answer(answer).replace(",", "").strip()
        return 1.0 if gold.isdigit() and int(pred) == int(gold) else 0.0

    def verify(self, response: str, answer: str) -> tuple[bool, bool]:
        """(format_valid, correct); correct = a full reward."""
        return self.format_valid(response), self.reward(response, answer) == 1.0


TASK = AdditionTask()
# The module's functions, as before (callers and tests import them by name).
make_problem = TASK.make_problem
generate_splits = TASK.generate_splits
verify = TASK.verify
reward = TASK.reward
