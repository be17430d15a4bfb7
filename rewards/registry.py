"""The embedded tasks by name (``data.task``). A task is one class that holds its data, its prompt and its reward:

* ``addition`` (the default, ``configs.schema.DEFAULT_TASK``): :class:`~rewards.addition_task.AdditionTask` in
  rewards/addition_task.py -- multi-digit addition with a column-by-column scratchpad.
* ``arithmetic``: :class:`~rewards.math_task.ArithmeticTask` in rewards/math_task.py -- one-fact word problems;
  also the verifier of GSM8K / OpenMathInstruct-2 files.

Each has ``name``, ``system_prompt`` (embedded/tiny_model.chat_prompt), ``make_problem(rng, ...)`` -> a
question / answer / solution row, ``generate_splits(out_dir, ...)`` (the jsonl files), ``reward(response, answer)``
-> float and ``verify(response, answer)`` -> (format_valid, correct), correct meaning a full reward of 1.0.

To change the embedded task's reward, edit ``AdditionTask.reward`` in rewards/addition_task.py
(``ArithmeticTask.reward`` in rewards/math_task.py for ``data.task: arithmetic``). Everything that scores a
response goes through it: the RL step's rewards and validation (tasks/rl.py, via ``verify``: a response is correct
when its reward is 1.0 and then scores 1.0, so rewards stay binary there), the SFT warm start's check
(embedded/bootstrap.py) and rewards/verifiers.py.
"""

from __future__ import annotations

from configs.schema import DEFAULT_TASK
from rewards.addition_task import AdditionTask
from rewards.math_task import ArithmeticTask

__all__ = ["DEFAULT_TASK", "TASKS", "get_task"]

TASKS = {t.name: t for t in (AdditionTask(), ArithmeticTask())}


def get_task(name: str) -> AdditionTask | ArithmeticTask:
    """The task called ``name`` (``data.task``)."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"data.task: unknown task {name!r} (one of {', '.join(TASKS)})") from None
