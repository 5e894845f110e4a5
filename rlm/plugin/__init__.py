"""The plugin contract and registry. The names are imported on first use (PEP 562), so that reading the registry's
table (``rlm plugins``) does not import torch. Core layer: no module of rlm/ imports rlm.plugins.
"""

from __future__ import annotations

import importlib
from typing import Any

_BASE = ("Claim", "Mode", "ParamGroup", "Plugin", "Slot", "check_layers", "make_config")
_WHERE = {**dict.fromkeys(_BASE, "base"), "Context": "context", "KVCache": "cache"}
_WHERE |= dict.fromkeys(("known_plugins", "resolve"), "registry")


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlm.plugin' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlm.plugin.{_WHERE[name]}"), name)
