"""The ``rlm`` command: a small table of subcommands.

``fit``, ``validate`` and ``test`` run LightningCLI on the deep-merged ``--config`` files; ``generate``
samples from a checkpoint; ``index`` and ``experiment`` hand over to their own parsers.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable

from pytorch_lightning.cli import LightningCLI

from rlm.config_merge import config_text, merge_configs, split_config_args


class RLMCLI(LightningCLI):
    """LightningCLI with the data module's vocabulary copied into the model config."""

    def before_instantiate_classes(self) -> None:
        # Not parser.link_arguments: jsonargparse 4.53 then rejects every field of the optional ModelConfig
        # ("does not accept option 'model.model.d_model'"), so the copy is made after parsing instead.
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        from rlm.config_check import check_fit, check_sections

        # Clear errors before anything is built: unknown keys, max_steps 0, unwritable output folders.
        if self.subcommand == "fit":
            check_fit(cfg)
        else:
            check_sections(cfg.get("model"))
        if cfg.get("model.model") is not None:
            cfg.model.model.vocab_size = cfg.data.vocab_size

    def _parse_ckpt_path(self) -> None:
        # `last` is looked up across the run's folders; a damaged file is named; resuming `fit` under another
        # model or plugin config is refused naming the keys that differ (LightningCLI would silently replace
        # the model config with the checkpoint's).
        from rlm.resume import prepare_ckpt_path

        prepare_ckpt_path(self.config)
        super()._parse_ckpt_path()


def run_lightning(command: str, args: list[str]) -> int:
    """``rlm fit|validate|test``: merge the stacked configs, then run LightningCLI."""
    from rlm.config_override import apply_plugin_flags, split_plugin_args
    from rlm.data import RLMDataModule
    from rlm.lightning import LMModule

    configs, rest = split_config_args(args)
    plugin_flags, rest = split_plugin_args(rest)
    merged = apply_plugin_flags(merge_configs(configs), plugin_flags) if configs or plugin_flags else None
    # The merged config travels as YAML text (jsonargparse reads a --config value that is not a file as YAML):
    # no temporary file to leave behind when the process is killed.
    RLMCLI(
        LMModule,
        RLMDataModule,
        args=[command, *(["--config", config_text(merged)] if merged is not None else []), *rest],
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
    )
    return 0


def run_generate(command: str, args: list[str]) -> int:
    """``rlm generate --ckpt PATH --prompt TEXT``: sample a continuation."""
    import torch

    from rlm.data import RLMDataModule
    from rlm.generate import sample
    from rlm.lightning import LMModule

    p = argparse.ArgumentParser(prog="rlm generate", description="Sample text from a checkpoint.")
    p.add_argument("--ckpt", required=True, help="checkpoint written by rlm fit")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(args)
    if not os.path.isfile(a.ckpt):
        p.error(f"--ckpt {a.ckpt!r} does not exist")
    from rlm.checkpoint import load_checkpoint_file

    ckpt = load_checkpoint_file(a.ckpt)  # a damaged file is named, not a traceback
    data_hp = ckpt.get("datamodule_hyper_parameters")
    if not data_hp:
        p.error(f"{a.ckpt!r} holds no data module settings, so its tokenizer cannot be found")
    accepted = inspect.signature(RLMDataModule).parameters
    data = RLMDataModule(**{**{k: v for k, v in data_hp.items() if k in accepted}, "progress": False})
    data.prepare_data()
    data.setup("predict")
    module = LMModule.load_from_checkpoint(a.ckpt, map_location="cpu")
    tok = data.tokenizer
    gen = torch.Generator().manual_seed(a.seed)
    out = sample(
        module, [tok.bos_id, *tok.encode(a.prompt)], a.max_new_tokens, a.temperature, a.top_k, tok.eos_id, gen
    )
    print(a.prompt + tok.decode(out))
    return 0


def run_index(command: str, args: list[str]) -> int:
    """``rlm index build|search|eval|info``."""
    from rlm.index.cli import main as index_main

    return index_main(args) or 0


def run_experiment(command: str, args: list[str]) -> int:
    """``rlm experiment run|report``."""
    from rlm.experiment import main as experiment_main

    return experiment_main(args) or 0


COMMANDS: dict[str, tuple[Callable[[str, list[str]], int], str]] = {
    "fit": (run_lightning, "train a model (LightningCLI; stack --config files)"),
    "validate": (run_lightning, "evaluate on the validation split"),
    "test": (run_lightning, "evaluate on the test split"),
    "generate": (run_generate, "sample text from a checkpoint"),
    "index": (run_index, "build, search, evaluate and inspect retrieval indices"),
    "experiment": (run_experiment, "run plugin comparisons and report them"),
}


def usage() -> str:
    """The top-level help text."""
    lines = ["usage: rlm COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`rlm COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rlm: unknown command {command!r}; known commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command][0](command, rest)
    except (ValueError, OSError) as err:  # OSError: disk full, read-only folder (the path is in the message)
        if os.environ.get("RLM_DEBUG"):
            raise
        print(f"rlm {command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
