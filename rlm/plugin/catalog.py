"""What ``rlm plugins`` prints: the plugins one can name, and each one's options with their docstrings."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlm.plugin import registry


def plugin_table() -> list[tuple[str, str, str]]:
    """(name, source, one-line description) of every plugin that can be named, sorted by name.

    Built-ins are described from the registry's table, without importing them (so without torch); an
    entry-point plugin is imported for the first line of its class docstring.
    """
    rows = {
        n: ("built-in", registry.DESCRIPTIONS.get(n, ""))
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
    """The attribute docstring under each field of a dataclass, inherited fields included (as jsonargparse reads them)."""
    import docstring_parser

    docs: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):  # bases first, so a subclass's docstring wins
        if dataclasses.is_dataclass(cls):
            for param in docstring_parser.parse_from_object(cls).params:
                if param.description:
                    docs[param.arg_name] = " ".join(param.description.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def describe_plugin(name: str) -> str:
    """``rlm plugins NAME``: the plugin's description and every option with its type, default and docstring."""
    cls = registry.resolve(name)
    config = cls.Config
    lines = [f"{name}: {_first_line(cls.__doc__)}", f"  class: {cls.__module__}.{cls.__qualname__}", ""]
    if not dataclasses.is_dataclass(config):
        return "\n".join([*lines, "  (no options)"])
    docs = field_docs(config)
    lines.append(f"options (model.plugins.{name}.OPTION):")
    for f in dataclasses.fields(config):
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        lines.append(f"  {f.name}: {type_name} = {_default(f)!r}")
        if f.name in docs:
            lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)
