"""What ``rlm plugins`` prints: the plugins one can name, and each one's options with their docstrings; and the
options' list of ``rlm fit --help``. Built-ins are read from source (``ast``), so listing them imports no torch;
entry points, and built-ins whose source is not plain enough (a computed default), are imported.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import textwrap
import types
import typing
from typing import Any

from rlm.plugin import registry


def plugin_table() -> list[tuple[str, str, str]]:
    """(name, source, one-line description) of every plugin that can be named, sorted by name."""
    rows = {
        n: ("built-in", _first_line(ast.get_docstring(_class_node(*t.split(":"))[1]) or ""))
        for n, t in registry.BUILTIN.items()
        if registry._builtin_available(t)
    }
    for name, ep in registry._entry_points().items():
        if name in rows:  # resolve() prefers the built-in of that name
            continue
        try:
            rows[name] = (f"entry point {ep.value}", _first_line(ep.load().__doc__))
        except Exception as err:  # a broken third-party package must not hide the others
            rows[name] = (f"entry point {ep.value}", f"(cannot be imported: {err})")
    return [(name, *rows[name]) for name in sorted(rows)]


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n")[0]


def field_docs(config_cls: type) -> dict[str, str]:
    """The attribute docstring under each field of a dataclass, inherited ones included (as jsonargparse reads)."""
    import docstring_parser

    docs: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):  # bases first, so a subclass's docstring wins
        if dataclasses.is_dataclass(cls):
            for param in docstring_parser.parse_from_object(cls).params:
                if param.description:
                    docs[param.arg_name] = " ".join(param.description.split())
    return docs


def _type_text(tp: Any) -> str:
    """An option's type as ``rlm fit --help`` lists it, a Literal as its choices: ``bool | {auto}``, ``list[int]``."""
    if typing.get_origin(tp) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(tp))) + "}"
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(map(_type_text, typing.get_args(tp)))
    return "null" if tp is type(None) else tp.__name__ if isinstance(tp, type) else str(tp)


@functools.cache
def options_help(plugins: type) -> str:
    """Every option of every plugin in ``plugins`` (registry.plugins_config(), the type of model.plugins) with its
    type, default and docstring, as ``rlm fit --help`` lists them."""
    lines = []
    for f in dataclasses.fields(plugins):
        config = next(a for a in typing.get_args(f.type) if a is not type(None))  # Config | None
        if not dataclasses.is_dataclass(config):  # a plugin without options (Config = object)
            continue
        docs, hints = field_docs(config), typing.get_type_hints(config)
        for option in dataclasses.fields(config):
            default = "null" if (d := _default(option)) is None else d
            lines.append(
                f"--model.plugins.{f.name}.{option.name} {_type_text(hints[option.name])} (default: {default})"
            )
            lines += textwrap.wrap(
                docs.get(option.name, ""), 96, initial_indent=" " * 4, subsequent_indent=" " * 4
            )
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


class _NotPlain(Exception):
    """A source construct the static reader does not evaluate: import the plugin instead."""


def _class_node(module: str, name: str) -> tuple[str, ast.ClassDef]:
    """(the module that defines it, the class statement) of ``module.name``, following ``from M import name``."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise _NotPlain(module)
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and any(a.name == name and not a.asname for a in node.names)
        ):
            return _class_node(node.module, name)
    raise _NotPlain(f"{module}.{name}")


def _value(node: ast.expr | None) -> Any:
    """A field's default: a literal, or field(default=...) / field(default_factory=list | dict | lambda: literal)."""
    if node is None:
        return "(required)"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        kw = {k.arg: k.value for k in node.keywords}
        if "default" in kw:
            return _value(kw["default"])
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
            return [] if factory.id == "list" else {}
        if isinstance(factory, ast.Lambda):
            return _value(factory.body)
        raise _NotPlain(ast.dump(node))
    try:
        return ast.literal_eval(node)
    except ValueError as err:
        raise _NotPlain(ast.dump(node)) from err


def _fields(module: str, name: str) -> list[tuple[str, str, Any, str]]:
    """(name, annotation as written, default, attribute docstring) of a dataclass's fields, bases' first."""
    where, cls = _class_node(module, name)
    out: dict[str, tuple[str, str, Any, str]] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            out.update({f[0]: f for f in _fields(where, base.id)})
    body = cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" in ast.unparse(node.annotation):
                continue
            nxt = body[i + 1].value if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) else None
            plain = isinstance(nxt, ast.Constant) and isinstance(nxt.value, str)
            doc = " ".join(nxt.value.split()) if plain else ""
            annotation = ast.unparse(node.annotation)  # as ``from __future__ import annotations`` keeps it
            out[node.target.id] = (node.target.id, annotation, _value(node.value), doc)
    return list(out.values())


def _static_options(target: str) -> tuple[str, list[tuple[str, str, Any, str]]] | None:
    """(the class docstring's first line, its Config's fields) of a built-in ``module:Class``, read from source;
    None when the source does not say them plainly."""
    module, name = target.split(":")
    try:
        where, cls = _class_node(module, name)
        config = next(
            (n.value.id for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
             and any(isinstance(t, ast.Name) and t.id == "Config" for t in n.targets)),
            None,
        )  # fmt: skip
        return _first_line(ast.get_docstring(cls)), ([] if config is None else _fields(where, config))
    except _NotPlain:
        return None


def describe_plugin(name: str) -> str:
    """``rlm plugins NAME``: the plugin's description and every option with its type, default and docstring."""
    target = registry.BUILTIN.get(name)
    static = _static_options(target) if target and registry._builtin_available(target) else None
    if static is not None:
        (first, fields), where = static, target.replace(":", ".")
    else:
        cls = registry.resolve(name)
        first, where, config = _first_line(cls.__doc__), f"{cls.__module__}.{cls.__qualname__}", cls.Config
        fields = []
        if dataclasses.is_dataclass(config):
            docs = field_docs(config)
            for f in dataclasses.fields(config):
                type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
                fields.append((f.name, type_name, _default(f), docs.get(f.name, "")))
    lines = [f"{name}: {first}", f"  class: {where}", ""]
    if not fields:
        return "\n".join([*lines, "  (no options)"])
    lines.append(f"options (model.plugins.{name}.OPTION):")
    for field_name, annotation, default, doc in fields:
        lines.append(f"  {field_name}: {annotation} = {default!r}")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)
