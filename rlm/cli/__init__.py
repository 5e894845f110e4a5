"""The ``rlm`` command (console script ``rlm.cli:main``) and the LightningCLI plumbing behind ``rlm fit``.

- ``commands``: the table of subcommands and ``main``;
- ``support``, ``check``: checks of the arguments and of the parsed config;
- ``lightning_cli``: ``RLMCLI``, LightningCLI with rlm's additions.
- ``summary``: the block ``fit``, ``eval`` and ``experiment run`` print at their end (where the files went,
  the next commands).

``commands`` sits on top and may import anything, torch and Lightning only inside the commands. The plumbing
may import rlm.train, rlm.eval, rlm.model, rlm.data, rlm.plugin and rlm.extras; rlm.experiment and
rlm.index.cli use it to read configs as ``rlm fit`` does, so it never imports them, nor ``commands``.
Nothing is imported here until a name is asked for (PEP 562): ``rlm --help`` imports neither torch nor
Lightning, and importing ``rlm.cli.support`` does not load the command table.
"""

from __future__ import annotations

import importlib
from typing import Any

_COMMANDS = (
    "COMMANDS",
    "main",
    "run_lightning",
    "usage",
    "version",
)

__all__ = ["COMMANDS", "RLMCLI", "main"]


def __getattr__(name: str) -> Any:
    if name in _COMMANDS:
        return getattr(importlib.import_module("rlm.cli.commands"), name)
    if name == "RLMCLI":
        return importlib.import_module("rlm.cli.lightning_cli").RLMCLI
    raise AttributeError(f"module 'rlm.cli' has no attribute {name!r}")
