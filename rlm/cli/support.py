"""Checks and fixes around LightningCLI for ``rlm fit|validate|test`` (no torch): refused optimizer options (they
would drop the plugins' parameter groups and the schedule), ``--print_config`` printed after the vocabulary is
linked, known third-party noise filtered, and jsonargparse's errors in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from argparse import RawDescriptionHelpFormatter
from pathlib import Path
from typing import Any

from rlm.extras import require

REFUSED = ("optimizer", "lr_scheduler")
PRINT_CONFIG = "--print_config"
PRINT_FLAGS = {
    "": None,
    "skip_default": "skip_default",
    "skip_null": "skip_none",
    "comments": "with_comments",
}


def config_layers(args: list[str]) -> list[dict[str, Any]]:
    """Each ``--config`` value of ``args`` (a file's path or YAML text) as a mapping, in order; ValueError naming a
    file that is missing or not valid YAML, or does not hold a mapping."""
    import yaml

    values = [
        a.split("=", 1)[1] if a.startswith("--config=") else args[i + 1]
        for i, a in enumerate(args)
        if a.startswith("--config=") or (a in ("--config", "-c") and i + 1 < len(args))
    ]
    layers = []
    for value in values:
        try:
            is_file = Path(value).is_file()
        except OSError:  # YAML text longer than a file name
            is_file = False
        if not is_file and "\n" not in value and value.endswith((".yaml", ".yml")):
            raise ValueError(f"config file {value!r} does not exist")
        what = f"config file {value!r}" if is_file else "--config text"
        try:
            data = yaml.safe_load(Path(value).read_text() if is_file else value)
        except yaml.YAMLError as err:
            raise ValueError(f"{what} is not valid YAML: {err}") from err
        if not isinstance(data, dict | None):
            raise ValueError(f"{what} must hold a mapping at the top level, got {type(data).__name__}")
        layers.append(data or {})
    return layers


def check_configs(command: str, args: list[str]) -> list[dict[str, Any]]:
    """The ``--config`` layers of ``args``, each file read once, after the checks below."""
    layers = config_layers(args)
    refuse_optimizer_options(command, layers, args)
    check_plugin_names(layers, args)
    require_class_extras(layers, args)
    return layers


def check_plugin_names(layers: list[dict[str, Any]], args: list[str]) -> None:
    """ValueError naming a plugin that no registry entry or entry point knows, in a config file or a
    ``--model.plugins`` flag (jsonargparse would drop an unknown key of the plugins' dataclass silently)."""
    import yaml

    from rlm.plugin.registry import known_plugins

    named = [n for layer in layers for n in ((layer.get("model") or {}).get("plugins") or {})]
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key == "--model.plugins":
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                given = yaml.safe_load(value)
            except yaml.YAMLError as err:
                raise ValueError(f"--model.plugins {value!r} is not valid YAML/JSON ({err})") from err
            named += list(given) if isinstance(given, dict) else []
        elif key.startswith("--model.plugins.") and key.split(".")[2] != "help":  # jsonargparse's own flag
            named.append(key.split(".")[2])
    known = known_plugins()
    for name in named:
        if name not in known:
            raise ValueError(f"unknown plugin {name!r}; known plugins: {known}")


def refuse_optimizer_options(command: str, layers: list[dict[str, Any]], args: list[str]) -> None:
    """ValueError when a config file or the arguments set LightningCLI's optimizer or lr_scheduler."""
    given = [f"--{k}" for k in REFUSED for a in args if a == f"--{k}" or a.startswith((f"--{k}=", f"--{k}."))]
    given += [f"{k}: (config file)" for k in REFUSED if any(layer.get(k) is not None for layer in layers)]
    if given:
        raise ValueError(
            f"{sorted(set(given))} are not supported by rlm {command}: the optimizer is AdamW over the model's "
            "parameter groups (plugins' groups such as the PKM values keep their own learning rates) with a "
            "warmup + cosine schedule. Set model.optim.lr, betas, eps, weight_decay, warmup_steps or "
            "min_lr_ratio instead, e.g. --model.optim.lr=1e-3"
        )


# Classes a config may name whose package is an extra of rlm: class name -> (package, extra).
CLASS_EXTRAS = {"WandbLogger": ("wandb", "wandb")}


def require_class_extras(layers: list[dict[str, Any]], args: list[str]) -> None:
    """MissingExtra naming ``pip install 'rlm[extra]'`` for a class the config names (e.g. a logger) whose package
    is not installed; LightningCLI would bury that hint in a parser error about Union subtypes."""

    def class_paths(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [node["class_path"]] if isinstance(node.get("class_path"), str) else []
            return own + [c for v in node.values() for c in class_paths(v)]
        return [c for v in node for c in class_paths(v)] if isinstance(node, list) else []

    for name in [*class_paths(layers), *(a.rsplit("=", 1)[-1] for a in args)]:
        if name.rsplit(".", 1)[-1] in CLASS_EXTRAS:
            require(*CLASS_EXTRAS[name.rsplit(".", 1)[-1]], name)


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
    """Resolve the data's vocabulary size (a given tokenizer's number of ids when unset) and copy it into the model
    config (a parsed LightningCLI namespace)."""
    # Not parser.link_arguments: jsonargparse then rejects every field of the optional ModelConfig
    # ("does not accept option 'model.model.d_model'"), so the copy is made after parsing instead.
    from rlm.data.pretrained import resolve_vocab_size

    cfg.data.vocab_size = resolve_vocab_size(cfg.data.vocab_size, cfg.data.get("tokenizer"))
    if cfg.get("model.model") is not None:
        cfg.model.model.vocab_size = cfg.data.vocab_size


# Lightning 2.6's advertisement for its cloud logger (INFO, rank zero, every run without LitLogger).
LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"
# torch's FutureWarning that Lightning 2.6's own pytree helper triggers mid progress bar.
PYTREE_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
# LMModule overrides the hook on purpose (it keeps the batch's host copy) and Lightning does use it.
HOOK_NOTE = (
    r"You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a "
    r"`LightningDataModule`"
)


class _DropLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LITLOGGER_TIP)


def quiet_known_noise() -> None:
    """Filter the LitLogger tip, the LeafSpec deprecation warning and the note on LMModule's batch transfer hook,
    and nothing else (idempotent)."""
    warnings.filterwarnings(
        "ignore",
        message=PYTREE_WARNING,
        category=FutureWarning,
        module=r"pytorch_lightning\.utilities\._pytree",
    )
    warnings.filterwarnings("ignore", message=HOOK_NOTE, category=UserWarning)
    log = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    if not any(isinstance(f, _DropLine) for f in log.filters):
        log.addFilter(_DropLine())


def canonical_flags(command: str, args: list[str]) -> list[str]:
    """rlm fit/validate/test's arguments in LightningCLI's spelling: ``--ckpt`` is ``--ckpt_path``; validate/test's
    ``--datastore DIR`` is the kNN-LM callback (rlm.eval.knnlm.DatastoreEval) on that datastore. Only option
    names change, never values; everything after ``--`` is left as it is."""
    end = args.index("--") if "--" in args else len(args)
    out, i = [], 0
    while i < end:
        arg = args[i]
        if command in ("validate", "test") and (arg == "--datastore" or arg.startswith("--datastore=")):
            value = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < end else "")
            if not value or value.startswith("--"):
                raise ValueError("--datastore needs a directory: a datastore built by `rlm knnlm build`")
            out += [
                "--trainer.callbacks+=rlm.eval.knnlm.DatastoreEval",
                f"--trainer.callbacks.datastore={value}",
            ]
            i += 1 if "=" in arg else 2
            continue
        out.append(("--ckpt_path" + arg[6:]) if arg == "--ckpt" or arg.startswith("--ckpt=") else arg)
        i += 1
    return out + args[end:]


_SPHINX_ROLE = re.compile(r":(?:paramref|class|func|meth|attr|obj|mod):`~?([\w.]+)`")


def plain_help(text: str) -> str:
    """Help text without Sphinx roles: ``:paramref:`~a.b.Trainer.max_steps``` reads ``max_steps``."""
    return _SPHINX_ROLE.sub(lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)


def help_formatter() -> type:
    """jsonargparse's help formatter with Lightning's Sphinx markup removed and descriptions keeping their lines (the
    plugins' options; ``rlm fit --help``)."""
    from jsonargparse import DefaultHelpFormatter

    class PlainHelpFormatter(DefaultHelpFormatter, RawDescriptionHelpFormatter):
        def _expand_help(self, action: Any) -> str:
            return plain_help(super()._expand_help(action))

    return PlainHelpFormatter


def _section_class(keys: list[str]) -> type | None:
    """The dataclass behind a dotted config section: model.model, model.optim or model.plugins.NAME."""
    from rlm.model.config import ModelConfig
    from rlm.plugin.registry import resolve
    from rlm.train.module import OptimConfig

    section = ".".join(keys)
    if section.startswith("model.plugins.") and section.count(".") == 2:
        return resolve(section.rsplit(".", 1)[1]).Config
    return {"model.model": ModelConfig, "model.optim": OptimConfig}.get(section)


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "a bool (true/false)", "str": "a string"}
# An option typed by a union of plain types and Literals (bool | Literal["auto"]): one "Expected a" per arm.
_UNION = re.compile(
    r'Parser key "([^"]+)":\s*Does not validate against any of the Union subtypes\s*Subtypes: .*\n\s*Errors:\n'
    r"((?:\s*- Expected a .*\n)+)\s*Given value type: .*\n\s*Given value: (.*)"
)
# Lines of jsonargparse's union report that frame the reason rather than give it.
_NOISE = ("Parser key", "Subtypes:", "Errors:", "Expected a <class 'NoneType'>", "Problem with given class_path",
          "Does not validate against", "Given value")  # fmt: skip


def _accepted(expected: str) -> str:
    """One arm of a union in words: "typing.Literal['a', 'b']" -> "one of 'a', 'b'", "<class 'int'>" -> ..."""
    if m := re.fullmatch(r"typing\.Literal\[(.*)\]", expected):
        return f"one of {m.group(1)}" if "," in m.group(1) else m.group(1)
    name = expected.removeprefix("<class '").removesuffix("'>")
    return "null" if name == "NoneType" else _TYPE_WORDS.get(name, name)


def plain_parse_error(message: str) -> str:
    """jsonargparse's nested report of a bad value in one line: the dotted key and the innermost reason (a plugin
    option's error comes wrapped in two Union reports), e.g. ``model.plugins.pkm.n_keys: must be an integer, got
    'abc'``."""
    lines = [ln.strip() for ln in message.splitlines()]
    keys = [m.group(1) for ln in lines if (m := re.match(r'(?:- )?Parser key "([^"]+)"', ln))]
    reasons = [r for ln in lines if (r := ln.removeprefix("- ")) and not r.startswith(_NOISE)]
    if not reasons:
        return message.strip()
    if keys and (union := [m for m in _UNION.finditer(message) if m.group(1) == keys[-1]]):
        arms = " or ".join(_accepted(a) for a in re.findall(r"Expected a (.*)", union[-1].group(2)))
        return f"{'.'.join(keys)}: must be {arms}, got {union[-1].group(3)!r}"
    reason = reasons[-1]
    # a flag given last with no value reaches jsonargparse as "" (stripped here with the line's space)
    if m := re.match(r"Expected a <class '(\w+)'>\. Got value:\s?(.*)", reason):
        reason = f"must be {_TYPE_WORDS.get(m.group(1), m.group(1))}, got {m.group(2)!r}"
    elif m := re.match(r"Expected a typing\.Literal\[(.*)\]\. Got value:\s?(.*)", reason):
        reason = f"must be one of {m.group(1)}, got {m.group(2)!r}"
    elif (m := re.match(r"Option '(\w+)' is not accepted", reason)) and (cls := _section_class(keys)):
        reason = f"unknown key {m.group(1)!r}; accepted: {[f.name for f in dataclasses.fields(cls)]}"
    return f"{'.'.join(keys)}: {reason}" if keys else reason
