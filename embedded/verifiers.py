"""Score a response by task name: ``verify(task, response, answer)`` -> ``(format_valid, correct)`` and ``reward``.

One line each over the task classes (embedded/tasks.py, where the registry and how to change a reward are
described): ``addition`` -> embedded/addition_task.AdditionTask, ``arithmetic`` -> embedded/math_task.ArithmeticTask.
"""

from __future__ import annotations

from embedded.tasks import TASKS, get_task

__all__ = ["TASKS", "reward", "verify"]


def verify(task: str, response: str, answer: str) -> tuple[bool, bool]:
    return get_task(task).verify(response, answer)


def reward(task: str, response: str, answer: str) -> float:
    return get_task(task).reward(response, answer)
