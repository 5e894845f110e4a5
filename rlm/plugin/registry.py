"""Finding plugins: a small name table (the core imports no plugin but through its strings), the ``rlm.plugins``
entry-point group, or a ``class_path``."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `rlm plugins` reads the table below without importing torch
    from rlm.plugin.base import Plugin

# Built-in plugins: short name -> "module:Class". Imported lazily, only when named.
BUILTIN: dict[str, str] = {
    "tokenid": "rlm.plugins.tokenid:TokenIDPlugin",
    "moe": "rlm.plugins.moe:MoEPlugin",
    "partial_experts": "rlm.plugins.partial_experts:PartialExpertsPlugin",
    "pkm": "rlm.plugins.pkm:PKMPlugin",
    "altup": "rlm.plugins.altup:AltUpPlugin",
    "retrieval": "rlm.plugins.retrieval:RetrievalPlugin",
    "token_memory": "rlm.plugins.token_memory:TokenMemoryPlugin",
    "knn_attention": "rlm.plugins.knn_attention:KnnAttentionPlugin",
}

ENTRY_POINT_GROUP = "rlm.plugins"


def _builtin_available(target: str) -> bool:
    module = target.split(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_plugins() -> list[str]:
    """Every plugin name that can be resolved: built-ins and third-party entry points."""
    names = {n for n, t in BUILTIN.items() if _builtin_available(t)} | set(_entry_points())
    return sorted(names)


def load_class(path: str) -> type:
    """Import ``package.module.Class`` or ``package.module:Class``."""
    module, _, attr = path.replace(":", ".").rpartition(".") if ":" not in path else path.partition(":")
    if not module or not attr:
        raise ValueError(f"class_path {path!r} must look like 'package.module.Class'")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import plugin class_path {path!r}: {err}") from err
    return obj


def resolve(name: str, class_path: str | None = None) -> type[Plugin]:
    """The plugin class for a config entry: by class_path if given, else by registered name."""
    from rlm.plugin.base import Plugin

    if class_path:
        cls = load_class(class_path)
    elif name in BUILTIN and _builtin_available(BUILTIN[name]):
        cls = load_class(BUILTIN[name])
    elif name in (eps := _entry_points()):
        cls = eps[name].load()
    else:
        raise ValueError(f"unknown plugin {name!r}; known plugins: {known_plugins()} (or give a class_path)")
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise ValueError(f"plugin {name!r} resolves to {cls!r}, which is not a subclass of rlm.plugin.Plugin")
    return cls


def parse_spec(name: str, spec: Any) -> tuple[type[Plugin], dict[str, Any]] | None:
    """One entry of ``model.plugins`` (``true``, ``{field: value}`` or ``{class_path, init_args}``) as its class
    and options; None for a disabled plugin (``null`` or ``false``)."""
    if spec is None or spec is False:
        return None
    if spec is True:
        spec = {}
    if not isinstance(spec, dict):
        raise ValueError(f"plugin {name!r}: expected a mapping of options, got {spec!r}")
    spec = dict(spec)
    class_path = spec.pop("class_path", None)
    if "init_args" in spec:
        init_args = spec.pop("init_args") or {}
        if spec:
            raise ValueError(
                f"plugin {name!r}: keys {sorted(spec)} beside init_args; put options inside init_args"
            )
        spec = dict(init_args)
    return resolve(name, class_path), spec


def validate_specs(specs: dict[str, Any] | None) -> list[str]:
    """Every problem in a ``model.plugins`` mapping, as messages (empty when it is valid)."""
    from rlm.plugin.base import make_config

    problems = []
    for name, spec in (specs or {}).items():
        try:
            parsed = parse_spec(name, spec)
            if parsed is not None:
                make_config(parsed[0], parsed[1])
        except (ValueError, TypeError) as err:
            problems.append(str(err))
    return problems


@functools.cache
def plugins_config() -> type:
    """The type of ``model.plugins``: a dataclass with one optional field per known plugin, typed by its Config
    (None: disabled), so jsonargparse merges stacked files key by key and types every option. Imports every plugin."""
    fields = []
    for name in known_plugins():
        cls = resolve(name)
        doc = (cls.__doc__ or "").strip().split("\n")[0]
        fields.append((name, cls.Config | None, dataclasses.field(default=None, metadata={"doc": doc})))
    made = dataclasses.make_dataclass("PluginsConfig", fields)
    made.__doc__ = (
        "Memory plugins to use, by name; null (the default) leaves a plugin out.\n\nArgs:\n"
        + "\n".join(f"    {n}: {f.metadata['doc']}" for n, _, f in fields)
    )  # Google style: jsonargparse prints each line as its field's help
    # jsonargparse finds the type again by its import path
    made.__module__ = __name__
    sys.modules[__name__].PluginsConfig = made
    return made


def plain(value: Any) -> Any:
    """``value`` with lists for tuples, so hparams.yaml stays plain YAML and configs compare alike."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, list | tuple) else value


def full_specs(specs: dict[str, Any] | None) -> dict[str, Any]:
    """Each enabled plugin's options with every default filled in, so a checkpoint that saved only some
    compares equal to one that saved all; entries that do not build are kept as they are."""
    from rlm.plugin.base import make_config

    out = {}
    for name, spec in (specs or {}).items():
        try:
            parsed = parse_spec(name, spec)
            out[name] = None if parsed is None else plain(dataclasses.asdict(make_config(*parsed)))
        except (ValueError, TypeError):
            out[name] = spec
    return out


def plugin_specs(plugins: Any) -> dict[str, Any]:
    """``model.plugins`` as the name -> options mapping checkpoints store (of the typed dataclass, the enabled
    plugins)."""
    if plugins is None:
        return {}
    if dataclasses.is_dataclass(plugins) and not isinstance(plugins, type):
        return {
            f.name: plain(dataclasses.asdict(value))
            for f in dataclasses.fields(plugins)
            if (value := getattr(plugins, f.name)) is not None
        }
    if not isinstance(plugins, dict):
        raise ValueError(f"model.plugins must map plugin names to options, got {plugins!r}")
    return dict(plugins)
