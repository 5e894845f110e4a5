"""``--model.plugins...`` flags merged key by key into the merged config, typed by each plugin's Config.

LightningCLI treats ``model.plugins`` as one dict-valued argument: a dotted flag
(``--model.plugins.pkm.mode=add``) replaces the plugin's whole mapping, a JSON ``--model.plugins '{...}'``
drops the plugins the config files set, and dotted values arrive as strings. So these flags are taken out of
the arguments before LightningCLI sees them and applied, in command-line order, on top of the deep-merged
``--config`` files:

- ``--model.plugins VALUE``: a YAML/JSON mapping of plugin name -> options, merged plugin by plugin and key by
  key (a plugin set to ``null`` is disabled);
- ``--model.plugins.NAME VALUE``: a mapping merged into that plugin, or ``null``/``false`` (disable),
  ``true`` (enable with its defaults);
- ``--model.plugins.NAME.OPTION VALUE``: one option, parsed to the type of the plugin's Config field.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from rlm.plugin.options import field_types, parse_option
from rlm.plugin.registry import parse_spec

PREFIX = "--model.plugins"


def split_plugin_args(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Take ``--model.plugins[.NAME[.OPTION]] VALUE`` (or ``=VALUE``) out of ``argv``: (flags in order, rest)."""
    flags: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key == PREFIX or key.startswith(PREFIX + "."):
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{key} needs a value")
                value = argv[i + 1]
                i += 1
            flags.append((key[2:], value))
        else:
            rest.append(arg)
        i += 1
    return flags, rest


def _load(flag: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"--{flag}: {text!r} is not valid YAML/JSON ({err})") from err


def _merge_plugin(plugins: dict[str, Any], name: str, value: Any, flag: str) -> None:
    """Merge one plugin's new spec into ``plugins`` key by key; None/False disable it, True enables it."""
    if value is None or value is False:
        plugins[name] = None
        return
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"--{flag}: plugin {name!r} needs a mapping of options, null or true; got {value!r}")
    old = plugins.get(name)
    old = dict(old) if isinstance(old, dict) else {}
    for key, v in value.items():
        if isinstance(v, dict) and isinstance(old.get(key), dict):
            old[key] = {**old[key], **v}  # init_args merge key by key too
        else:
            old[key] = v
    plugins[name] = old


def _set_option(plugins: dict[str, Any], name: str, option: str, text: str, flag: str) -> None:
    """Set one option of plugin ``name`` from a command-line string typed by the plugin's Config."""
    spec = plugins.get(name)
    spec = dict(spec) if isinstance(spec, dict) else {}
    parsed = parse_spec(name, spec)
    assert parsed is not None  # a mapping is never the disabled form
    types_ = field_types(parsed[0].Config)
    if option not in types_:
        raise ValueError(f"--{flag}: plugin {name!r} has no option {option!r}; accepted: {sorted(types_)}")
    value = parse_option(name, option, text, types_[option])
    if "init_args" in spec:
        spec["init_args"] = {**(spec["init_args"] or {}), option: value}
    else:
        spec[option] = value
    plugins[name] = spec


def apply_plugin_flags(cfg: dict[str, Any], flags: list[tuple[str, str]]) -> dict[str, Any]:
    """``cfg`` (a merged config) with the ``--model.plugins...`` flags applied in order; ``cfg`` is not changed."""
    cfg = copy.deepcopy(cfg)
    if not flags:
        return cfg
    model = cfg.get("model")
    model = cfg["model"] = dict(model) if isinstance(model, dict) else {}
    plugins = model.get("plugins")
    plugins = dict(plugins) if isinstance(plugins, dict) else {}
    for flag, text in flags:
        parts = flag.split(".")[2:]  # after model.plugins
        if not parts:
            value = _load(flag, text)
            if value is None:
                plugins = {}
                continue
            if not isinstance(value, dict):
                raise ValueError(f"--{flag}: expected a mapping of plugin name -> options, got {value!r}")
            for name, spec in value.items():
                _merge_plugin(plugins, name, spec, flag)
        elif len(parts) == 1:
            _merge_plugin(plugins, parts[0], _load(flag, text), flag)
        elif len(parts) == 2 or (len(parts) == 3 and parts[1] == "init_args"):
            _set_option(plugins, parts[0], parts[-1], text, flag)
        else:
            raise ValueError(
                f"--{flag}: plugin flags are --model.plugins.NAME.OPTION; nested options are not"
            )
    model["plugins"] = plugins
    return cfg
