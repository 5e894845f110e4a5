"""LightningCLI with rlm's additions, apart from rlm/cli.py so that ``rlm --help`` imports neither torch nor Lightning."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from pytorch_lightning.cli import LightningCLI

from rlm.lightning import config_diff
from rlm.model.config import ModelConfig


class RLMCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary copied into the model config."""

    def before_instantiate_classes(self) -> None:
        # Not parser.link_arguments: jsonargparse 4.53 then rejects every field of the optional ModelConfig
        # ("does not accept option 'model.model.d_model'"), so the copy is made after parsing instead.
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.get("model.model") is not None:
            cfg.model.model.vocab_size = cfg.data.vocab_size

    def _parse_ckpt_path(self) -> None:
        # LightningCLI silently replaces the model config with the checkpoint's when --ckpt_path is given.
        # For evaluation that is what one wants; resuming `fit` under a different model or plugin config is a
        # mistake, so it is refused naming what differs.
        if self.config.get("subcommand") == "fit":
            cfg = self.config["fit"]
            path = cfg.get("ckpt_path")
            if path and Path(path).is_file():
                saved = torch.load(path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
                current = cfg.model.as_dict()
                if current.get("model") is not None:
                    current["model"]["vocab_size"] = cfg.data.vocab_size
                current["model"] = asdict(ModelConfig(**(current.get("model") or {})))
                diffs = config_diff(saved, current)
                if diffs:
                    raise ValueError(
                        f"--ckpt_path {path} was written by a different config:\n  " + "\n  ".join(diffs)
                    )
        super()._parse_ckpt_path()
