"""The ``rlm`` command (console script ``rlm.cli:main``): ``commands`` holds the table of subcommands and ``main``;
``support`` and ``check`` check the arguments and the parsed config, ``lightning_cli`` is LightningCLI with rlm's
additions, ``summary`` prints where a run's files went. This package and ``commands`` import neither torch nor
Lightning at the top, so ``rlm --help`` costs neither."""

from rlm.cli.commands import main

__all__ = ["main"]
