"""Checks and fixes around LightningCLI for ``rlm fit|validate|test`` (kept apart from rlm/cli/commands.py; no torch).

- ``--optimizer`` / ``--lr_scheduler`` (LightningCLI's automatic optimizer options) would replace the model's
  ``configure_optimizers`` and so silently drop the plugins' parameter groups (e.g. the PKM values' own Adam)
  and the warmup + cosine schedule: they are refused, naming the options that do the job.
- ``--print_config`` is printed after the model's vocabulary is linked to the data's, so it shows what runs.
- ``--trainer.default_root_dir`` on the command line reaches the config's ``${trainer.default_root_dir}``
  interpolations (the loggers' directories, hence the checkpoints').
"""

from __future__ import annotations

from typing import Any

REFUSED = ("optimizer", "lr_scheduler")
PRINT_CONFIG = "--print_config"
PRINT_FLAGS = {
    "": None,
    "skip_default": "skip_default",
    "skip_null": "skip_none",
    "comments": "with_comments",
}


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in ``args`` (the last one given), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def refuse_optimizer_options(command: str, merged: dict[str, Any], args: list[str]) -> None:
    """ValueError when the config or the arguments set LightningCLI's optimizer or lr_scheduler."""
    given = [f"--{k}" for k in REFUSED for a in args if a == f"--{k}" or a.startswith((f"--{k}=", f"--{k}."))]
    given += [f"{k}: (config file)" for k in REFUSED if merged.get(k) is not None]
    if given:
        raise ValueError(
            f"{sorted(set(given))} are not supported by rlm {command}: the optimizer is AdamW over the model's "
            "parameter groups (plugins' groups such as the PKM values keep their own learning rates) with a "
            "warmup + cosine schedule. Set model.optim.lr, betas, eps, weight_decay, warmup_steps or "
            "min_lr_ratio instead, e.g. --model.optim.lr=1e-3"
        )


def pop_print_config(args: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """``args`` without ``--print_config[=flags]``, and the jsonargparse dump options it asked for (or None)."""
    rest, options = [], None
    for arg in args:
        if arg == PRINT_CONFIG or arg.startswith(PRINT_CONFIG + "="):
            flags = arg.split("=", 1)[1].split(",") if "=" in arg else [""]
            bad = [f for f in flags if f not in PRINT_FLAGS]
            if bad:
                raise ValueError(f"{PRINT_CONFIG} flags {bad}; accepted: {[f for f in PRINT_FLAGS if f]}")
            options = {PRINT_FLAGS[f]: True for f in flags if PRINT_FLAGS[f]}
        else:
            rest.append(arg)
    return rest, options


def link_vocab(cfg: Any) -> None:
    """Resolve the data module's vocabulary size (a given tokenizer's number of ids when unset) and copy it into
    the model config (a parsed LightningCLI namespace)."""
    # Not parser.link_arguments: jsonargparse 4.53 then rejects every field of the optional ModelConfig
    # ("does not accept option 'model.model.d_model'"), so the copy is made after parsing instead.
    from rlm.data.pretrained import resolve_vocab_size

    cfg.data.vocab_size = resolve_vocab_size(cfg.data.vocab_size, cfg.data.get("tokenizer"))
    if cfg.get("model.model") is not None:
        cfg.model.model.vocab_size = cfg.data.vocab_size
