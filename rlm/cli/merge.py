"""Composing stacked YAML config files before LightningCLI sees them.

LightningCLI replaces a dict-valued argument (such as ``model.plugins``) wholesale when two config files
set it, so plugin fragments would not stack. We deep-merge every ``--config`` file first (OmegaConf.merge:
mappings merge key by key, so plugins merge by name) and hand LightningCLI one merged file. A file may
name others to start from with a top-level ``include: [path, ...]`` (relative to that file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

CONFIG_FLAGS = ("--config", "-c")


def load_config(path: str | Path, _stack: tuple[Path, ...] = ()) -> DictConfig:
    """Load one YAML file with its ``include`` chain merged underneath it."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    if path in _stack:
        raise ValueError(f"config include cycle: {' -> '.join(str(p) for p in (*_stack, path))}")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    includes = cfg.pop("include", None) or []
    if isinstance(includes, str):
        includes = [includes]
    merged = OmegaConf.create()
    for inc in includes:
        merged = OmegaConf.merge(merged, load_config(path.parent / inc, (*_stack, path)))
    return OmegaConf.merge(merged, cfg)


def merge_configs(paths: list[str | Path | dict[str, Any]]) -> dict[str, Any]:
    """Deep-merge config files (or mappings) in order (later ones win key by key) and resolve interpolations."""
    merged = OmegaConf.create()
    for p in paths:
        merged = OmegaConf.merge(merged, OmegaConf.create(p) if isinstance(p, dict) else load_config(p))
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def split_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--config FILE`` / ``--config=FILE`` arguments from the rest."""
    configs, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in CONFIG_FLAGS:
            if i + 1 >= len(argv):
                raise ValueError(f"{arg} needs a file name")
            configs.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return configs, rest


def config_text(cfg: dict[str, Any]) -> str:
    """A merged config as YAML text (what ``--config`` accepts in place of a file name)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg))
