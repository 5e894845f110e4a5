"""Validating an experiment before anything trains, listing every problem at once: the file's structure, each
variant's plugin specs, its merged config parsed by the ``rlm fit`` parser (one error per parse, so a failing
variant is parsed again one override at a time), and its model built on the meta device (parameter counts)."""

from __future__ import annotations

import argparse
import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlm.experiment.spec import (
    Experiment,
    ExperimentError,
    apply_overrides,
    flatten,
    merge,
    parse_experiment,
    run_config,
    unflatten,
)
from rlm.plugin.registry import validate_specs

CHECK_DIR = Path(tempfile.gettempdir()) / "rlm-experiment-check"  # the run directory of configs only parsed


@dataclass
class ParamCounts:
    """A model's parameter counts."""

    total: int
    added: int  # by the plugins, over the base model
    active: int  # used by one token: total minus what the plugins report unused per token


def count_parameters(model_cfg: dict[str, Any], plugins: dict[str, Any] | None) -> ParamCounts:
    """Parameter counts of a model built from its config on the meta device (no memory, no init cost)."""
    import torch  # here, not at the top: a file that fails the structure pass is named without torch

    from rlm.model.config import ModelConfig
    from rlm.model.transformer import Transformer

    config = ModelConfig(**model_cfg)
    try:
        with torch.device("meta"):
            model = Transformer(config, plugins or {})
    except (RuntimeError, NotImplementedError):  # a plugin that needs real tensors to build: pay for memory
        model = Transformer(config, plugins or {})
    return ParamCounts(model.num_parameters(), model.added_parameters(), model.active_parameters())


@functools.lru_cache(maxsize=1)
def _fit_parser() -> argparse.ArgumentParser:
    """The parser ``rlm fit`` uses (jsonargparse via LightningCLI), built without parsing or running."""
    from rlm.cli.lightning_cli import RLMCLI
    from rlm.data.module import RLMDataModule
    from rlm.train.module import LMModule

    class ParseOnly(RLMCLI):
        def parse_arguments(self, parser: Any, args: Any) -> None:
            self.config = parser.get_defaults()

        def instantiate_classes(self) -> None:
            pass

    kwargs = {"parser_mode": "omegaconf", "exit_on_error": False}
    return ParseOnly(
        LMModule, RLMDataModule, args=[], run=False, parser_kwargs=kwargs, seed_everything_default=False
    ).parser


def _parse(cfg: dict[str, Any]) -> tuple[Any, str | None]:
    """A merged run config parsed by the ``rlm fit`` parser: the namespace, or the error."""
    from rlm.cli.support import plain_parse_error

    try:
        return _fit_parser().parse_object(cfg), None
    except (argparse.ArgumentError, ValueError, TypeError, KeyError) as err:
        return None, plain_parse_error(str(err))


def _without(mapping: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """A nested mapping without the given dotted leaves."""
    return merge([], {}, *(unflatten(key, value) for key, value in flatten(mapping) if key not in keys))


def _blame(exp: Experiment, name: str) -> tuple[list[str], dict[str, set[str]]]:
    """Which single overrides of a failing variant fail on their own: messages, and the bad keys per place."""
    files = [*exp.base, *exp.variants[name].configs]
    problems, bad = [], {"common": set(), "set": set()}
    for place, where, mapping in (
        ("common", "common", exp.common),
        ("set", f"variant {name!r}: set", exp.variants[name].set),
    ):
        for key, value in flatten(mapping):
            _, err = _parse(run_config(merge(files, unflatten(key, value), skip_missing=True), 0, CHECK_DIR))
            if err:
                problems.append(f"{where}.{key} = {value!r}: {err}")
                bad[place].add(key)
    return problems, bad


def _instantiate_configs(ns: Any, plugins: dict[str, Any]) -> ParamCounts:
    """Run the model, optimizer and data configs' own checks; the model's parameter counts."""
    from rlm.data.module import RLMDataModule
    from rlm.train.module import OptimConfig

    if ns.model.optim is not None:
        OptimConfig(**ns.model.optim.as_dict())
    data = RLMDataModule(**ns.data.as_dict())
    model_cfg = ns.model.model.as_dict() if ns.model.model is not None else {}
    model_cfg["vocab_size"] = data.vocab_size  # as rlm fit copies it (a given tokenizer's size when unset)
    return count_parameters(model_cfg, plugins)


def check_experiment(
    path: str | Path,
    sets: list[str] | None = None,
    seeds: list[int] | None = None,
    base: list[str] | None = None,
) -> tuple[Experiment, dict[str, ParamCounts]]:
    """Validate an experiment file with the command line's ``--set``, ``--seeds`` and ``--base`` applied; the
    experiment and each variant's parameter counts, or :class:`ExperimentError` listing every problem."""
    exp, problems = parse_experiment(path)
    if exp is None:
        raise ExperimentError(path, problems)
    apply_overrides(exp, sets or [], seeds, problems, base)
    counts: dict[str, ParamCounts] = {}
    for name, variant in exp.variants.items():
        files = [*exp.base, *variant.configs]
        try:
            cfg = merge(files, exp.common, variant.set, skip_missing=True)
        except ValueError as err:
            problems.append(f"variant {name!r}: {err}")
            continue
        plugins = ((cfg.get("model") or {}).get("plugins")) or {}
        plugin_problems = (
            validate_specs(plugins) if isinstance(plugins, dict) else ["model.plugins must be a mapping"]
        )
        problems += [f"variant {name!r}: {p}" for p in plugin_problems]
        ns, err = _parse(run_config(cfg, exp.seeds[0], CHECK_DIR))
        if err:
            # Name each bad override, then go on without them to find the variant's other problems.
            blamed, bad = _blame(exp, name)
            # a plugin problem already reported above is not reported again in the parser's words
            problems += [
                p for p in blamed if p not in problems and not (plugin_problems and ".plugins." in p)
            ]
            common, overrides = _without(exp.common, bad["common"]), _without(variant.set, bad["set"])
            ns, err = _parse(run_config(merge(files, common, overrides, skip_missing=True), 0, CHECK_DIR))
            if err:
                problems.append(f"variant {name!r}: {err}")
                continue
        if plugin_problems:
            continue
        try:
            counts[name] = _instantiate_configs(ns, plugins)
        except (ValueError, TypeError) as err:
            problems.append(f"variant {name!r}: {err}")
    if problems:
        raise ExperimentError(exp.path, problems)
    return exp, counts
