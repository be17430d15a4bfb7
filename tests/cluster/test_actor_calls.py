"""Calls into the trainer actors name the method as PolicyWorker's attribute, never as a string: a reader (and a
linter, and a rename) can follow ``policy_call(names, PolicyWorker.train_step, ...)`` into trainer/policy.py."""
import ast
from pathlib import Path

import pytest

from cluster.runtime import RAY_CALL, _policy_method_name
from trainer.policy import PolicyWorker

ROOT = Path(__file__).resolve().parents[2]
FAN_OUT = ("policy_call", "policy_refs")


def string_method_calls(root: Path) -> list[str]:
    """``file:line: helper('name')`` for every fan-out call under ``root`` whose method argument is a string other than
    Ray's own RAY_CALL."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if ".venv" in path.parts or "runs" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            arg = node.args[1]
            if name in FAN_OUT and isinstance(arg, ast.Constant) and isinstance(arg.value, str) and \
                    arg.value != RAY_CALL:
                out.append(f"{path.relative_to(root)}:{node.lineno}: {name}({arg.value!r})")
    return out


def test_no_actor_method_is_called_by_its_name_as_a_string():
    assert string_method_calls(ROOT) == []


def test_the_string_check_can_fail(tmp_path):
    (tmp_path / "x.py").write_text('policy_call(names, "train_step", 1)\nrt.policy_refs(n, "memory")\n'
                                   'policy_call(names, PolicyWorker.train_step)\npolicy_refs(n, "__ray_call__", f)\n')
    assert string_method_calls(tmp_path) == ["x.py:1: policy_call('train_step')", "x.py:2: policy_refs('memory')"]


def test_the_helpers_take_policyworker_methods_only():
    assert _policy_method_name(PolicyWorker.train_step) == "train_step" and _policy_method_name(RAY_CALL) == RAY_CALL
    for bad in ("train_step", len, PolicyWorker):
        with pytest.raises(TypeError, match="expected a PolicyWorker method"):
            _policy_method_name(bad)
