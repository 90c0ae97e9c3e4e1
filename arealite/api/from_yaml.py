"""Dataclass configs from nested dicts (parsed YAML), each value checked against its annotation.

:func:`from_dict` and :func:`check_type` (re-exported by :mod:`arealite.api.cli`, which is where
callers import them from) name the dotted path of every bad key or value in a
:class:`~arealite.api.usage.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar

from arealite.api.usage import ConfigError

T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a nested dict (e.g. parsed YAML), recursing into fields.

    Raises:
        ConfigError (a ValueError): an unknown key (names the dotted path and lists the valid
            keys), a value of the wrong type (names the path, the expected type and the value),
            or a section that is not a mapping.
    """
    if not isinstance(data, dict):
        raise ConfigError(where or "config", f"expected a mapping of keys (a YAML section), got "
                          f"{type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(path, f"unknown config key; valid keys here: {sorted(names)}")
        sub = _dataclass_of(hints[key])
        if sub is not None and value is not None:
            kwargs[key] = from_dict(sub, value, path)
        else:
            kwargs[key] = check_type(path, hints[key], value)
    return cls(**kwargs)


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_type(path: str, tp: Any, value: Any) -> Any:
    """``value`` checked against the annotation ``tp`` of field ``path`` (YAML values): bool,
    int (not bool), float (an int is widened; a numeric string such as YAML's ``1e-5`` is
    converted), str, ``Literal[...]``, ``list[X]`` and ``X | None``. Other annotations pass.

    Returns: the value (converted for float fields). Raises: :class:`ConfigError`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_type(path, arg, value)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(path, f"expected {' or '.join(_type_name(a) for a in args)}, got "
                                f"{type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"{value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r} (YAML: [a, b])")
        return [check_type(f"{path}[{i}]", args[0], v) for i, v in enumerate(value)] if args else value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(path, f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
            except ValueError:
                pass
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(path, f"expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {type(value).__name__} {value!r} (quote it in YAML)")
        return value
    return value
