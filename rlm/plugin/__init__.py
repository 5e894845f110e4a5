"""The plugin contract and registry."""

from rlm.plugin.base import LAYERLESS, Claim, Mode, ParamGroup, Plugin, Slot, check_layers, make_config
from rlm.plugin.context import Context
from rlm.plugin.registry import known_plugins, resolve

__all__ = [
    "LAYERLESS",
    "Claim",
    "Context",
    "Mode",
    "ParamGroup",
    "Plugin",
    "Slot",
    "check_layers",
    "known_plugins",
    "make_config",
    "resolve",
]
