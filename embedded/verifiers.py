"""Which verifier scores a response: ``data.task`` names it (and, for ``embedded`` data, the generator too).

* ``addition`` (the embedded default): embedded/addition_task.py. Format-valid = exactly one ``\\boxed{digits}``,
  at the end of the response; correct = format-valid and equal to the gold sum.
* ``arithmetic``: embedded/math_task.py, also the verifier for GSM8K / OpenMathInstruct-2 files. Correct = the last
  ``\\boxed{}`` (else the last number) equals the gold answer (math-verify for non-numeric gold); format-valid = the
  response holds a ``\\boxed{}`` (a correct answer found by the last-number fallback is correct but not format-valid).

``verify(task, response, answer)`` returns ``(format_valid, correct)``; reward = 1.0 when correct.
"""

from __future__ import annotations

from embedded import addition_task, math_task

TASKS = ("addition", "arithmetic")
DEFAULT_TASK = "addition"


def verify(task: str, response: str, answer: str) -> tuple[bool, bool]:
    if task == "addition":
        return addition_task.verify(response, answer)
    if task == "arithmetic":
        return bool(math_task.boxed_contents(response)), math_task.is_correct(response, answer)
    raise ValueError(f"data.task: unknown task {task!r} (one of {', '.join(TASKS)})")


def reward(task: str, response: str, answer: str) -> float:
    return 1.0 if verify(task, response, answer)[1] else 0.0
