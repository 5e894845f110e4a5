"""The ``rlm`` command (console script ``rlm.cli:main``) and the LightningCLI plumbing behind ``rlm fit``.

``commands`` holds the table of subcommands and ``main``; ``support`` and ``check`` check the arguments and the
parsed config; ``lightning_cli`` is LightningCLI with rlm's additions; ``summary`` prints where a run's files went.
The plumbing never imports ``commands``, rlm.experiment nor rlm.index.cli, which read configs through it. Names
here are imported when asked for (PEP 562): ``rlm --help`` imports neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["COMMANDS", "RLMCLI", "main"]


def __getattr__(name: str) -> Any:
    if name in ("COMMANDS", "main"):
        return getattr(importlib.import_module("rlm.cli.commands"), name)
    if name == "RLMCLI":
        return importlib.import_module("rlm.cli.lightning_cli").RLMCLI
    raise AttributeError(f"module 'rlm.cli' has no attribute {name!r}")
