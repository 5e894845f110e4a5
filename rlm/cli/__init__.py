"""The ``rlm`` command (console script ``rlm.cli:main``) and the LightningCLI plumbing behind ``rlm fit``.

``commands`` holds the table of subcommands and ``main``; ``support`` and ``check`` check the arguments and the
parsed config; ``lightning_cli`` is LightningCLI with rlm's additions; ``summary`` prints where a run's files went.
The plumbing never imports ``commands``, rlm.experiment nor rlm.index.cli, which read configs through it. None of
them imports torch or Lightning at the top: ``rlm --help`` costs neither.
"""

from rlm.cli.commands import main

__all__ = ["main"]
