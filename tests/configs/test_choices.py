"""Each choice set is spelled once, in fp8core/choices.py: the schema's keys are annotated with its aliases (so the
loader accepts exactly what fp8core implements), and no product module writes one of its sets out by hand."""
import ast
import typing
from pathlib import Path

import pytest

from configs import sections
from fp8core import choices

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("cli", "cluster", "configs", "data", "embedded", "flows", "fp8core", "process", "rewards", "rollout",
           "storage", "tasks", "tools", "trainer")
SETS = {name: frozenset(getattr(choices, name)) for name in choices.__all__ if name.isupper()}

# schema key -> the fp8core set its annotation must be
KEYS = {
    "policy.megatron_cfg.fp8_cfg.fp8_recipe": "RECIPES", "policy.generation.vllm_cfg.fp8_recipe": "RECIPES",
    "policy.megatron_cfg.fp8_cfg.fp8": "LINEAR_FORMATS", "policy.megatron_cfg.fp8_cfg.backend": "GEMM_BACKENDS",
    "policy.bf16_mode": "BF16_MODES", "policy.generation.vllm_cfg.bf16_mode": "BF16_MODES",
    "loss_fn.reference_policy_kl_type": "KL_TYPES", "loss_fn.importance_sampling": "IMPORTANCE_SAMPLING",
    "policy.generation.vllm_cfg.kv_cache_dtype": "KV_CACHE_DTYPES",
    "policy.generation.vllm_cfg.kv_cache_impl": "KV_CACHE_IMPLS",
}


def _annotation(dotted: str):
    cls = sections.Config
    *path, last = dotted.split(".")
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return typing.get_type_hints(cls)[last]


def _literal_values(tp) -> tuple:
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is not typing.Literal else [tp]
    (lit,) = args
    return typing.get_args(lit)


@pytest.mark.parametrize("key", sorted(KEYS))
def test_the_schema_offers_exactly_fp8cores_choices(key):
    assert _literal_values(_annotation(key)) == getattr(choices, KEYS[key])


def hand_spelled(root: Path) -> list[str]:
    """``file:line: NAME`` for every tuple, list or Literal of strings in the product folders under ``root`` that
    equals one of fp8core.choices' sets, outside fp8core/choices.py itself."""
    out = []
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            if path.relative_to(root) == Path("fp8core/choices.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else None
                if elts is None or len(elts) < 2 or not all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                            for e in elts):
                    continue
                values = frozenset(e.value for e in elts)
                names = [n for n, s in SETS.items() if s == values and len(values) == len(elts)]
                if names:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {' / '.join(names)}")
    return out


def test_no_product_module_spells_a_choice_set_by_hand():
    assert hand_spelled(ROOT) == [], "import the set (or its Literal alias) from fp8core.choices"


def test_the_hand_spelling_check_can_fail(tmp_path):
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "x.py").write_text('from typing import Literal\nMODES = ("auto", "native", "emulated")\n'
                                               'K = Literal["k1", "k2", "k3"]\nOTHER = ("k1", "k2")\n')
    assert hand_spelled(tmp_path) == ["rollout/x.py:2: BF16_MODES / KV_CACHE_IMPLS", "rollout/x.py:3: KL_TYPES"]
