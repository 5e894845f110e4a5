"""The plugin contract and registry.

The names are imported on first use (PEP 562), so that reading the registry's table (``rlm plugins``) does
not import torch.

Core layer: imports nothing of rlm but rlm.model.config (annotations, and make_config's check of choices). The
registry names the plugins as strings and imports one only when it is asked for, so no module of rlm/ imports
rlm.plugins.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlm.plugin.base import LAYERLESS, Claim, Mode, ParamGroup, Plugin, Slot, check_layers, make_config
    from rlm.plugin.cache import KVCache
    from rlm.plugin.context import Context
    from rlm.plugin.registry import known_plugins, resolve

_BASE = ("LAYERLESS", "Claim", "Mode", "ParamGroup", "Plugin", "Slot", "check_layers", "make_config")
_WHERE = {**dict.fromkeys(_BASE, "base"), "Context": "context", "KVCache": "cache"}
_WHERE |= dict.fromkeys(("known_plugins", "resolve"), "registry")
__all__ = [
    "LAYERLESS",
    "Claim",
    "Context",
    "KVCache",
    "Mode",
    "ParamGroup",
    "Plugin",
    "Slot",
    "check_layers",
    "known_plugins",
    "make_config",
    "resolve",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlm.plugin' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlm.plugin.{_WHERE[name]}"), name)
