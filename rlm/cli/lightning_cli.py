"""LightningCLI with rlm's additions, apart from the command table so that ``rlm --help`` imports no torch."""

from __future__ import annotations

import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from jsonargparse import set_parsing_settings
from pytorch_lightning.callbacks import ProgressBar
from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

from rlm.cli.check import check_fit, lock_fit, new_dirs, remove_unused_dirs
from rlm.cli.summary import fit_summary
from rlm.cli.support import link_vocab, plain_parse_error, pop_print_config
from rlm.plugin.catalog import options_help
from rlm.plugin.registry import plugins_config
from rlm.train.module import LMModule
from rlm.train.progress import StepProgressBar
from rlm.train.resume import prepare_ckpt_path
from rlm.train.strategy import prepare_trainer


class SaveConfig(SaveConfigCallback):
    """SaveConfigCallback that remembers where it writes config.yaml, for the summary after fit."""

    path: Path | None = None  # the config.yaml it writes, if any

    def setup(self, trainer, pl_module, stage: str) -> None:
        # trainer.log_dir is a broadcast under DDP: read on every rank, not in after_fit, which only rank 0
        # runs (the ranks would wait for each other forever)
        self.path = Path(trainer.log_dir or "") / self.config_filename if self.save_to_log_dir else None
        super().setup(trainer, pl_module, stage)


class RLMCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary copied into the model config, no optimizer flags (they would
    drop the plugins' parameter groups and the schedule), and --print_config printing what runs."""

    _print_config: dict | None = None  # --print_config's dump options, taken out of the arguments

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("auto_configure_optimizers", False)
        # ${trainer.default_root_dir} in the configs is relative to the subcommand's section (fit.trainer...)
        set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        kwargs.setdefault("save_config_callback", SaveConfig)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        # jsonargparse lists the options of an `X | None` dataclass only two --help levels down (--model.plugins.help
        # PluginsConfig, then --model.plugins.NAME.help): each subcommand's help lists them, from the registry
        title = "Memory plugins' options (--model.plugins.NAME.OPTION VALUE, or model.plugins.NAME.OPTION in a config)"
        parser.add_argument_group(title, options_help(plugins_config()))

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit":  # max_steps 0, unwritable output folders: before anything is built
            check_fit(cfg)
        link_vocab(cfg)
        prepare_trainer(cfg.trainer)  # strategies rlm cannot run: a clear error; devices: auto on a CPU
        if self.subcommand == "fit":  # the last check: nothing is created in default_root_dir before it
            lock_fit(cfg)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        # rlm's bar (steps to max_steps) unless the config names a bar or turns it off: Lightning's own prints a
        # negative epoch total under max_steps.
        given = config.get("callbacks")
        given = [*(given if isinstance(given, list) else [given] if given else []), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in given
        ):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        # A fit failing before its first step removes the logger folders it created (remove_unused_dirs).
        trainer = self.trainer
        fresh = []
        if subcommand == "fit" and trainer.is_global_zero:
            fresh = new_dirs([Path(lg.log_dir) for lg in trainer.loggers if lg.log_dir])
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            if fresh and trainer.global_step == 0:  # nothing trained: nothing of value can be in them
                removed = remove_unused_dirs(fresh)
                for d in [d for d in removed if d.parent not in removed]:
                    print(f"rlm fit: removed {d}, created by this run before it failed", file=sys.stderr)
            raise

    def after_fit(self) -> None:
        # Where the run went and what to run next, once, from the first process.
        if self.trainer.is_global_zero:
            saved = [cb.path for cb in self.trainer.callbacks if isinstance(cb, SaveConfig)]
            module = self.trainer.lightning_module
            horizon = module.lr_horizon if isinstance(module, LMModule) else None
            print(fit_summary(self.trainer, saved[0] if saved else None, horizon), flush=True)

    def parse_arguments(self, parser, args) -> None:
        # without LightningCLI's warning about args next to sys.argv (run_lightning passes the whole command line);
        # --print_config is printed after the checkpoint and vocabulary are applied (_parse_ckpt_path).
        args, self._print_config = pop_print_config(list(args))
        try:
            self.config = parser.parse_args(args)
        except ArgumentError as err:  # exit_on_error=False: the error reaches rlm's one-line report
            raise ValueError(plain_parse_error(str(err))) from None

    def instantiate_classes(self) -> None:
        # a plugin Config's own check (__post_init__) fails here, wrapped in jsonargparse's union report
        try:
            super().instantiate_classes()
        except (ArgumentError, ValueError, TypeError) as err:
            if "Parser key" not in str(err) and "Union subtypes" not in str(err):
                raise
            raise ValueError(plain_parse_error(str(err))) from None

    def _parse_ckpt_path(self) -> None:
        # `last` is looked up across the run's folders; a damaged file is named; resuming `fit` under another model
        # or plugin config is refused naming the keys that differ (LightningCLI would silently take the checkpoint's)
        honoured = prepare_ckpt_path(self.config)
        super()._parse_ckpt_path()
        # the optim settings a resumed run may change (a new schedule horizon), over the checkpoint's
        for key, value in (honoured or {}).items():
            self.config[self.config["subcommand"]].model.optim[key] = value
        if self._print_config is not None:  # what runs: the checkpoint's model, the data's vocabulary
            sub = self.config["subcommand"]
            link_vocab(self.config[sub])
            print(self._parser(sub).dump(self.config[sub], **self._print_config), end="")
            sys.exit(0)
