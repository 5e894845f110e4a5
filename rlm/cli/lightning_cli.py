"""LightningCLI with rlm's additions, apart from the command table (rlm/cli/commands.py) so that ``rlm --help`` imports neither torch nor Lightning."""

from __future__ import annotations

import sys

from pytorch_lightning.cli import LightningCLI


class RLMCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary copied into the model config, no optimizer flags (they would
    drop the plugins' parameter groups), and --print_config printing what runs."""

    _print_config: dict | None = None
    """The --print_config dump options, when it was asked for (taken out of the arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        # No --optimizer / --lr_scheduler: they would drop the plugins' parameter groups and the schedule
        # (rlm.cli.support.refuse_optimizer_options explains it to the user).
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        from rlm.cli.check import check_fit, check_sections
        from rlm.cli.support import link_vocab
        from rlm.train.strategy import prepare_trainer

        cfg = self.config[self.subcommand] if self.subcommand else self.config
        # Clear errors before anything is built: unknown keys, max_steps 0, unwritable output folders.
        if self.subcommand == "fit":
            check_fit(cfg)
        else:
            check_sections(cfg.get("model"))
        link_vocab(cfg)
        prepare_trainer(cfg.trainer)  # strategies rlm cannot run: a clear error; devices: auto on a CPU
        if self.subcommand == "fit":  # the last check: nothing is created in default_root_dir before it
            from rlm.cli.check import lock_fit

            lock_fit(cfg)

    def parse_arguments(self, parser, args) -> None:
        # run_lightning always passes the whole command line as args, so LightningCLI's warning about args next
        # to sys.argv is noise; --print_config is printed after the checkpoint and vocabulary are applied.
        from rlm.cli.support import pop_print_config

        args, self._print_config = pop_print_config(list(args))
        self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        # `last` is looked up across the run's folders; a damaged file is named; resuming `fit` under another
        # model or plugin config is refused naming the keys that differ (LightningCLI would silently replace
        # the model config with the checkpoint's).
        from rlm.train.resume import prepare_ckpt_path

        prepare_ckpt_path(self.config)
        super()._parse_ckpt_path()
        if self._print_config is not None:  # what runs: the checkpoint's model, the data's vocabulary
            from rlm.cli.support import link_vocab

            sub = self.config["subcommand"]
            link_vocab(self.config[sub])
            print(self._parser(sub).dump(self.config[sub], **self._print_config), end="")
            sys.exit(0)
