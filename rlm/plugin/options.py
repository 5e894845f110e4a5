"""Plugin options typed by the plugin's Config dataclass: parsing command-line strings, checking given values.

A dotted flag such as ``--model.plugins.tokenid.rank=2`` arrives as the string ``"2"``; :func:`parse_option`
turns it into the field's type (ints and floats parsed, bools only from true/false/1/0/yes/no). Values from
YAML are already typed; :func:`check_option` refuses the clear mismatches (a string for a float, ``"off"``
for a bool) with a message naming the plugin, the option and what is accepted.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")
NULL_WORDS = ("null", "none", "~")


def field_types(config_cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation of a Config dataclass (string annotations evaluated)."""
    if not dataclasses.is_dataclass(config_cls):
        return {}
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # an annotation that cannot be evaluated: leave those values unchecked
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(config_cls)}


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union annotation (``int | None`` -> (int, NoneType)), else the annotation alone."""
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def describe(annotation: Any) -> str:
    """What a field accepts, in words."""
    words = []
    for t in _members(annotation):
        if t is type(None):
            words.append("null")
        elif t is bool:
            words.append("a bool (true/false/1/0/yes/no)")
        elif t is int:
            words.append("an integer")
        elif t is float:
            words.append("a number")
        elif t is str:
            words.append("a string")
        elif get_origin(t) is Literal:
            words.append("one of " + ", ".join(repr(a) for a in get_args(t)))
        elif get_origin(t) in (list, tuple):
            ints = get_args(t)[:1] == (int,)
            words.append("a list of integers such as [1, 3]" if ints else "a list such as [a, b]")
        else:
            words.append(getattr(t, "__name__", str(t)))
    return " or ".join(words)


def _where(owner: str) -> str:
    """``plugin 'pkm': `` for a plugin name, ``model.optim: `` for a dotted config section."""
    return f"{owner}: " if "." in owner else f"plugin {owner!r}: "


def _parse_one(text: str, t: Any) -> Any:
    """``text`` as type ``t``; raises ValueError when it is not one."""
    low = text.strip().lower()
    if t is type(None):
        if low in NULL_WORDS:
            return None
    elif t is bool:
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
            return False
    elif t is int:
        return int(text.strip())
    elif t is float:
        return float(text.strip())
    elif t is str:
        return text
    elif get_origin(t) is Literal:
        for choice in get_args(t):
            if str(choice) == text:
                return choice
    elif get_origin(t) in (list, tuple):
        value = yaml.safe_load(text)
        if isinstance(value, list):
            (inner, *_) = get_args(t) or (Any,)
            return [v if inner is Any or not isinstance(v, str) else _parse_one(v, inner) for v in value]
    else:
        return yaml.safe_load(text)
    raise ValueError(text)


def parse_option(plugin: str, name: str, text: str, annotation: Any) -> Any:
    """A command-line string for option ``name`` of ``plugin``, parsed to the field's type."""
    members = _members(annotation)
    # None first so that `null` is not taken as the string "null"; str last so that it only catches the rest.
    order = sorted(members, key=lambda t: (t is not type(None), t is str))
    for t in order:
        try:
            return _parse_one(text, t)
        except (ValueError, TypeError, yaml.YAMLError):
            continue
    raise ValueError(f"{_where(plugin)}option {name} must be {describe(annotation)}, got {text!r}")


def _matches(value: Any, t: Any) -> bool:
    if t is Any:
        return True
    if t is type(None):
        return value is None
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t is str:
        return isinstance(value, str)
    if get_origin(t) is Literal:
        return value in get_args(t)
    if get_origin(t) in (list, tuple):
        return isinstance(value, list | tuple)
    return True  # other annotations: the plugin's own __post_init__ checks them


def check_option(plugin: str, name: str, value: Any, annotation: Any) -> None:
    """Refuse a value that is plainly not of the field's type, naming the plugin, option and accepted values."""
    if not any(_matches(value, t) for t in _members(annotation)):
        raise ValueError(f"{_where(plugin)}option {name} must be {describe(annotation)}, got {value!r}")
