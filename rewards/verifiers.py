"""Score a response by task name: ``verify(task, response, answer)`` -> ``(format_valid, correct)`` and ``reward``.

One line each over the task classes (rewards/registry.py, where the registry and how to change a reward are
described): ``addition`` -> rewards/addition_task.AdditionTask, ``arithmetic`` -> rewards/math_task.ArithmeticTask.
"""

from __future__ import annotations

from rewards.registry import TASKS, get_task

__all__ = ["TASKS", "reward", "verify"]


def verify(task: str, response: str, answer: str) -> tuple[bool, bool]:
    return get_task(task).verify(response, answer)


def reward(task: str, response: str, answer: str) -> float:
    return get_task(task).reward(response, answer)
