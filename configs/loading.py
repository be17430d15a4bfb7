"""Loading a recipe: the YAML file (with ``defaults:`` bases), the dotted ``key=value`` overrides, and the
conversion of the merged dict to the dataclasses of configs/sections.py, checking every value against its
annotation."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from configs.sections import Config, ConfigError, DataCfg, GenerationCfg, VllmCfg


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp, value, path: str):
    """Check ``value`` against the annotation ``tp`` (recursively) and return it in dataclass form."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or '<root>'}: expected a mapping (section), got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise ConfigError(f"{path}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads '1e-4' (no dot) as a string: accept numeric strings of that form.
            try:
                number = float(value) if isinstance(value, str) else None
            except ValueError:
                number = None
            if number is None:
                raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
            value = number
        value = float(value)
        if not math.isfinite(value):  # .nan / .inf parse as YAML floats; no setting means either
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover - schema bug


def _build(cls, data: Mapping, path: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{path}." if path else ""
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (valid keys here: {', '.join(sorted(names))})")
    kwargs = {k: _convert(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # pragma: no cover - schema bug
        raise ConfigError(f"{path or '<root>'}: {e}") from e


def deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"defaults: circular recipe inheritance through {path}")
    if not path.exists():
        raise ConfigError(f"recipe file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"{path}: is a directory, not a recipe file (a .yaml file, e.g. configs/tiny_fp8_e2e.yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}{_yaml_where(e)}: not valid YAML: {_yaml_problem(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as a recipe: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping at top level")
    base = data.pop("defaults", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"defaults: expected a recipe path string in {path}, got {base!r}")
    return deep_merge(_read_yaml(path.parent / base, (*seen, path)), data)


def _yaml_where(e: yaml.YAMLError) -> str:
    """':LINE:COLUMN' of a YAML error (1-based), or '' when PyYAML gives no position."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(e: yaml.YAMLError) -> str:
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    return ", ".join(p for p in parts if p) or str(e).splitlines()[0]


def parse_override(text: str) -> tuple[list[str], Any]:
    """'grpo.max_num_steps=2' → (['grpo', 'max_num_steps'], 2); the value is parsed as YAML ('null', 'true', '[1,2]')."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. grpo.max_num_steps=2)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: the override's value {raw!r} is not valid YAML: {_yaml_problem(e)}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = dict(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(f"{'.'.join(parts[:i + 1])}: is a value, cannot set {'.'.join(parts)}")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return data


def config_from_dict(data: Mapping, overrides: Sequence[str] = ()) -> Config:
    return _build(Config, apply_overrides(dict(data), overrides), "")


def standalone_engine_config(*, seed: int = 0, kv_scales_period: int = 1, **vllm_cfg: Any) -> Config:
    """A recipe for a rollout engine used on its own (benchmarks, diagnostics, tests): the schema's defaults with
    these ``policy.generation.vllm_cfg`` keys, ``grpo.seed`` and ``calibration.kv_scales_period``. The prompt budget
    (``data.max_input_seq_length``) shrinks to fit a short ``max_model_len``; nothing else is changed."""
    gen = GenerationCfg()
    max_len = vllm_cfg.get("max_model_len", VllmCfg.max_model_len)
    prompt = min(DataCfg.max_input_seq_length, max(1, max_len - gen.max_new_tokens))
    return config_from_dict({"policy": {"generation": {"vllm_cfg": dict(vllm_cfg)}},
                             "data": {"max_input_seq_length": prompt}, "grpo": {"seed": seed},
                             "calibration": {"kv_scales_period": kv_scales_period}})


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load a recipe file (+ ``defaults:`` bases) and apply ``key=value`` overrides; the ``recipe`` tag defaults to
    the file's stem."""
    path = Path(path)
    data = _read_yaml(path)
    data.setdefault("recipe", path.stem)
    return config_from_dict(data, overrides)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
