"""Typed records from parsed JSON: a dataclass built from a mapping, every field checked against its
annotation before the class sees it.

    record(DrafterConfig, value, "step-00000004/train_state.json", "drafter")

refuses, naming the file and the field (dotted for nested records, [i] for list elements):
  a value that is not an object, an unknown field, a missing required field, a value of another type
  ("field drafter.hidden_size must be an integer, found a string"), and whatever the class's own
  __post_init__ refuses (its ValueError, prefixed with the file).
Annotations understood: int, float (an integer is taken), str, bool, None, Any, Literal[...], unions
(X | None), list[T], tuple[T, ...], dict[str, T] and nested dataclasses. JSON's own booleans are never
integers here, as Python's are.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from shards.common.json_input import InputFileError, json_type

T = TypeVar("T")
REQUIRED: Any = object()  # read_field()'s default: the field must be present
_KEYS_SHOWN, _KEY_CHARS = 5, 40  # unknown or missing field names a message lists, and their length


def record(cls: type[T], value: Any, source: str, name: str = "") -> T:
    """`cls` built from the JSON object `value` read from `source`; `name` is the object's field path
    in the file ("" for the whole document)."""
    what = f"field {name}" if name else "the document"
    if not isinstance(value, Mapping):
        raise InputFileError(f"{source}: {what} must be an object, found {json_type(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    prefix = f"{name}." if name else ""
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise InputFileError(
            f"{source}: unknown field{'s' if len(unknown) > 1 else ''} {_names(prefix, unknown)} "
            f"(the fields of {name or 'the document'}: {', '.join(fields)})"
        )
    missing = [k for k, f in fields.items() if k not in value and _required(f)]
    if missing:
        raise InputFileError(f"{source}: missing field{'s' if len(missing) > 1 else ''} {_names(prefix, missing)}")
    hints = typing.get_type_hints(cls)
    checked = {k: typed(hints[k], v, source, prefix + k) for k, v in value.items()}
    try:
        return cls(**checked)
    except (TypeError, ValueError) as e:  # the class's own checks (__post_init__)
        raise InputFileError(f"{source}: {name + ': ' if name else ''}{e}") from e


def read_field(
    mapping: Mapping[str, Any], name: str, annotation: Any, source: str, default: Any = REQUIRED, where: str = ""
) -> Any:
    """One field of a mapping that holds more than a record's fields (a model's config.json): `default`
    when absent or null (REQUIRED: refused), else checked against `annotation`; named as the file
    names it, `where` + name (text_config.hidden_size)."""
    value = mapping.get(name)
    if value is None:
        if default is REQUIRED:
            raise InputFileError(f"{source}: missing field {where}{name}")
        return default
    return typed(annotation, value, source, where + name)


def typed(annotation: Any, value: Any, source: str, name: str) -> Any:
    """`value` checked against `annotation` (nested records built), or InputFileError naming the field."""
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        return record(annotation, value, source, name)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return _one_of(args, value, source, name)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):  # 1 == True, yet not the same
            raise InputFileError(f"{source}: field {name} must be one of {list(args)}, found {value!r}")
        return value
    if origin in (list, tuple):
        _expect(isinstance(value, list), "an array", value, source, name)
        item = args[0] if args else Any
        items = [typed(item, v, source, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        _expect(isinstance(value, dict), "an object", value, source, name)
        item = args[1] if args else Any
        return {k: typed(item, v, source, f"{name}.{_short(k)}") for k, v in value.items()}
    if annotation is list:
        _expect(isinstance(value, list), "an array", value, source, name)
        return value
    check, expected = _SCALARS[annotation]
    _expect(check(value), expected, value, source, name)
    return float(value) if annotation is float else value


_SCALARS: dict[Any, tuple[Any, str]] = {
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
    bool: (lambda v: isinstance(v, bool), "a boolean"),
    type(None): (lambda v: v is None, "null"),
}


def _one_of(options: tuple[Any, ...], value: Any, source: str, name: str) -> Any:
    if value is None and type(None) in options:
        return None
    present = [o for o in options if o is not type(None)]
    if len(present) == 1:  # X | None: X's own message, which says more
        return typed(present[0], value, source, name)
    for option in present:
        try:
            return typed(option, value, source, name)
        except InputFileError:
            continue
    names = " or ".join(_describe(o) for o in options)
    raise InputFileError(f"{source}: field {name} must be {names}, found {json_type(value)}")


def _describe(annotation: Any) -> str:
    if annotation in _SCALARS:
        return _SCALARS[annotation][1]
    origin = typing.get_origin(annotation)
    if origin in (list, tuple) or annotation is list:
        return "an array"
    return "an object"


def _expect(ok: bool, expected: str, value: Any, source: str, name: str) -> None:
    if not ok:
        raise InputFileError(f"{source}: field {name} must be {expected}, found {json_type(value)}")


def _names(prefix: str, keys: list[str]) -> str:
    """Field names for a message: the first few, each cut short (a crafted file's keys can be megabytes)."""
    shown = [prefix + _short(k) for k in keys[:_KEYS_SHOWN]]
    return ", ".join(shown) + (f" and {len(keys) - _KEYS_SHOWN} more" if len(keys) > _KEYS_SHOWN else "")


def _short(key: str) -> str:
    return key if len(key) <= _KEY_CHARS else f"{key[:_KEY_CHARS]}..."


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
