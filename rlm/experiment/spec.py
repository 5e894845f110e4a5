"""Reading an experiment file (format in :mod:`rlm.experiment`), its launcher options with the flags that override
them, and building each run's config."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

TOP_KEYS = "name description base common seeds baseline output report_metrics variants launcher".split()
VARIANT_KEYS = ("description", "configs", "set", "knnlm")
TIME_RE = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")  # [D-]A[:B[:C]]


def _int(lowest: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= lowest


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, kind)


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: v in choices


# option -> (whether a value is accepted, what is accepted)
Options = dict[str, tuple[Callable[[Any], bool], str]]
KNNLM_OPTIONS: Options = {
    "layer": (_one_of("final", "ffn_input", "attn_input"), "'final', 'ffn_input' or 'attn_input'"),
    "factory": (_is(str), "'auto' or a faiss factory string"),
    "k": (_int(1), "a positive integer"),
    "flat_below": (_int(0), "an integer >= 0"),
    "target_recall": (lambda v: type(v) in (int, float) and 0 < v <= 1, "a number in (0, 1]"),
    "tune_tokens": (_int(0), "an integer >= 0"),
    "max_documents": (_int(1), "a positive integer"),
    "cache": (_is(bool), "true or false"),
    "rule": (_one_of("interpolate", "joint", "model"), "'interpolate' (kNN-LM's eq. 2), 'joint' (the token "
             "memory's mixture) or 'model' (a knn_attention model searching the datastore inside its forward "
             "pass; layer attn_input)"),
}  # fmt: skip
"""A variant's ``knnlm`` stage: ``rlm knnlm build``'s options, ``cache`` (``rlm eval --knn-cache``) and ``rule``,
how the test loss mixes the neighbours in."""
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # names become directory names
DEFAULT_METRICS = ["val/*"]
LAUNCHER_DEFAULTS: dict[str, Any] = {"name": "local", "jobs": 1, "requeue": True, "signal_delay_s": 120}
LAUNCHERS = ("local", "slurm", "submitit-local")
"""local: this machine, ``jobs`` at once; slurm: a SLURM job per run through submitit; submitit-local:
the same jobs on this machine (a dry run of the job path)."""
LAUNCHER_OPTIONS: Options = {
    "name": (_one_of(*LAUNCHERS), f"one of {list(LAUNCHERS)}"),
    "jobs": (_int(1), "a positive integer (local: runs at once)"),
    "partition": (_is(str), "a SLURM partition name"),
    "gpus_per_job": (_int(0), "an integer >= 0"),
    "cpus_per_job": (_int(1), "a positive integer"),
    "mem_gb": (lambda v: type(v) in (int, float) and v > 0, "a positive number of GB"),
    "time": (lambda v: time_minutes(v) is not None, "SLURM's formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
             "or D-HH:MM:SS, e.g. 90 or '1-12:00:00'"),
    "requeue": (_is(bool), "true or false"),
    "signal_delay_s": (_int(10), "an integer >= 10 (seconds before the time limit when rlm fit is stopped)"),
    "account": (_is(str), "a SLURM account"),
    "qos": (_is(str), "a SLURM quality of service"),
    "constraint": (_is(str), "a SLURM node constraint"),
    "setup": (lambda v: type(v) is list and all(isinstance(line, str) for line in v),
              "a list of shell lines run before each job, e.g. ['module load cuda']"),
}  # fmt: skip


class ExperimentError(ValueError):
    """An experiment file with problems; ``problems`` lists every one of them."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.path, self.problems = str(path), list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"experiment file {self.path!r} has {n} problem{'s' * (n != 1)}:\n{lines}")


@dataclass
class Variant:
    """One variant: config fragments stacked on the base, and a mapping merged last."""

    name: str  # also its directory name
    configs: list[Path] = field(default_factory=list)  # absolute, stacked after the base files
    set: dict[str, Any] = field(default_factory=dict)  # deep-merged after everything else
    description: str = ""  # one line for results.md
    # The kNN-LM stage after training (KNNLM_OPTIONS), or None; not in the run's config, so a variant that only
    # adds it trains (or reuses) the same model as the one without it.
    knnlm: dict[str, Any] | None = None


@dataclass
class Experiment:
    """A parsed experiment file."""

    path: Path
    name: str  # names the output directory
    description: str  # what the experiment asks and what the paper found
    base: list[Path]  # config files every run starts from (absolute)
    common: dict[str, Any]  # merged into every run after the variant's configs
    seeds: list[int]
    baseline: str  # the variant the others are compared with
    variants: dict[str, Variant]  # in the file's order
    output: Path | None = None  # None: runs/experiments/NAME under the working directory
    report_metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))  # shown in results.md
    launcher: dict[str, Any] = field(default_factory=dict)  # LAUNCHER_OPTIONS; in no run's fingerprint

    def out_dir(self, override: str | Path | None = None) -> Path:
        """Where the runs and the report go."""
        return Path(override or self.output or Path("runs") / "experiments" / self.name)

    def to_json(self) -> dict[str, Any]:
        """What ``report`` needs to rebuild tables without the original file."""
        keys = "path name description base common seeds baseline report_metrics launcher".split()
        out = {key: getattr(self, key) for key in keys}
        out["variants"] = {
            v.name: {key: getattr(v, key) for key in ("configs", "set", "description", "knnlm")}
            for v in self.variants.values()
        }
        return json.loads(json.dumps(out, default=str))  # paths as strings


def time_minutes(value: Any) -> int | None:
    """A time limit in whole minutes (seconds round up), read as SLURM reads ``--time``: minutes, MM:SS,
    HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS; None if it is none of these or not positive."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    match = TIME_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        return None
    days, a, b, c = (None if g is None else int(g) for g in match.groups())
    hours_first = days is not None or c is not None  # D-HH[:MM[:SS]] or HH:MM:SS, not MM[:SS]
    h, m, sec = (a, b or 0, c or 0) if hours_first else (0, a, b or 0)
    if sec >= 60 or (hours_first and m >= 60):
        return None
    total = (days or 0) * 1440 + h * 60 + m + (sec > 0)
    return total if total > 0 else None


def checked_options(value: dict[str, Any], table: Options, where: str, problems: list[str]) -> dict[str, Any]:
    """The items of ``value`` that ``table`` takes; the others are problems."""
    out: dict[str, Any] = {}
    for key, option in value.items():
        if key not in table:
            problems.append(f"{where}: unknown option {key!r}; accepted: {list(table)}")
        elif not table[key][0](option):
            problems.append(f"{where}.{key}: got {option!r}; accepted: {table[key][1]}")
        else:
            out[key] = option
    return out


def resolve_launcher(from_file: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The launcher options a run uses: defaults, the file's mapping, then the flags (None: not given).
    ValueError naming every bad flag or combination."""
    problems: list[str] = []
    given = {k: v for k, v in flags.items() if v is not None}
    checked: dict[str, Any] = {}
    for key, value in given.items():  # each message names the flag: --gpus-per-job: got -1; accepted: ...
        mine: list[str] = []
        checked.update(checked_options({key: value}, LAUNCHER_OPTIONS, "launcher", mine))
        flag = "--launcher" if key == "name" else "--" + key.replace("_", "-")
        problems += [flag + p.removeprefix(f"launcher.{key}") for p in mine]
    options = {**LAUNCHER_DEFAULTS, **from_file, **checked}
    name = options["name"]
    if name == "slurm" and "time" not in options:
        problems.append("--launcher slurm needs a time limit per job: launcher.time in the file or --time, "
                        "e.g. --time 12:00:00 (SLURM's default limit would be submitit's 5 minutes)")  # fmt: skip
    if name != "local" and options["jobs"] != 1:
        problems.append(f"--jobs {options['jobs']} applies to --launcher local; with {name} every run is its own "
                        "job, and the scheduler decides how many run at once")  # fmt: skip
    if problems:
        raise ValueError("bad launcher options:\n" + "\n".join(f"  - {p}" for p in problems))
    options["time_min"] = time_minutes(options["time"]) if "time" in options else None
    return options


def _paths(value: Any, where: str, root: Path, problems: list[str]) -> list[Path]:
    """A list of config file paths relative to ``root``; missing files are problems."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{where}: expected a list of config file paths, got {value!r}")
        return []
    out = []
    for v in value:
        p = (root / v).resolve()
        if not p.is_file():
            problems.append(f"{where}: config file {v!r} does not exist (looked for {str(p)!r})")
        out.append(p)
    return out


def _mapping(value: Any, where: str, problems: list[str]) -> dict[str, Any]:
    if value is not None and not isinstance(value, dict):
        problems.append(f"{where}: expected a mapping of config keys, got {value!r}")
    return value if isinstance(value, dict) else {}


def _text(value: Any, where: str, problems: list[str]) -> str:
    if value and not isinstance(value, str):
        problems.append(f"{where}: expected a string, got {value!r}")
        return ""
    return (value or "").strip()


def _variant(name: Any, spec: Any, root: Path, problems: list[str]) -> Variant | None:
    where = f"variant {name!r}"
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append(f"{where}: names must be letters, digits and '_.+-' (they become directory names)")
        return None
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        problems.append(f"{where}: expected a mapping with keys {list(VARIANT_KEYS)}, got {spec!r}")
        return None
    unknown = sorted(set(spec) - set(VARIANT_KEYS))
    if unknown:
        problems.append(f"{where}: unknown key(s) {unknown}; accepted: {list(VARIANT_KEYS)}")
    return Variant(
        name=name,
        configs=_paths(spec.get("configs"), f"{where}.configs", root, problems),
        set=_mapping(spec.get("set"), f"{where}.set", problems),
        description=_text(spec.get("description"), f"{where}.description", problems),
        knnlm=_knnlm(spec.get("knnlm", None), f"{where}.knnlm", problems) if "knnlm" in spec else None,
    )


def _knnlm(value: Any, where: str, problems: list[str]) -> dict[str, Any] | None:
    """A variant's kNN-LM options: true or {} for the defaults, or a mapping of KNNLM_OPTIONS."""
    if value is True or value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{where}: expected true or a mapping of {list(KNNLM_OPTIONS)}, got {value!r}")
        return None
    return checked_options(value, KNNLM_OPTIONS, where, problems)


def _seeds(value: Any, problems: list[str]) -> list[int]:
    if value is None:
        return [0]
    if not (isinstance(value, list) and value and all(type(s) is int for s in value)):
        problems.append(f"seeds: expected a non-empty list of integers such as [0, 1], got {value!r}")
        return [0]
    if len(set(value)) != len(value):
        problems.append(f"seeds: {value} repeats a seed")
    return list(dict.fromkeys(value))


def parse_experiment(path: str | Path) -> tuple[Experiment | None, list[str]]:
    """Read an experiment file; returns it (None if unusable) and every structural problem found."""
    path = Path(path).resolve()
    if not path.is_file():
        return None, [f"experiment file {str(path)!r} does not exist"]
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        return None, [f"not valid YAML: {err}"]
    if not isinstance(raw, dict):
        return None, [
            f"expected a mapping with keys {list(TOP_KEYS)} at the top level, got {type(raw).__name__}"
        ]
    problems: list[str] = []
    root = path.parent
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        problems.append(f"unknown top-level key(s) {unknown}; accepted: {list(TOP_KEYS)}")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append(f"name: {name!r} must be letters, digits and '_.+-' (it names the output directory)")
        name = path.stem
    base = _paths(raw.get("base"), "base", root, problems)
    if not raw.get("base"):
        problems.append("base: name at least one config file every run starts from, e.g. [../default.yaml]")
    common = _mapping(raw.get("common"), "common", problems)
    seeds = _seeds(raw.get("seeds"), problems)
    raw_variants = raw.get("variants")
    if not isinstance(raw_variants, dict) or not raw_variants:
        problems.append(
            f"variants: expected a non-empty mapping of variant name -> spec, got {raw_variants!r}"
        )
        raw_variants = {}
    variants = [_variant(vname, vspec, root, problems) for vname, vspec in raw_variants.items()]
    baseline = raw.get("baseline", next(iter(raw_variants), ""))
    if raw_variants and baseline not in raw_variants:
        problems.append(f"baseline: {baseline!r} is not one of the variants {list(raw_variants)}")
    output = raw.get("output")
    if output is not None and not isinstance(output, str):
        problems.append(f"output: expected a directory path, got {output!r}")
        output = None
    metrics = raw.get("report_metrics", DEFAULT_METRICS)
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        problems.append(f"report_metrics: expected a list of patterns such as ['val/*'], got {metrics!r}")
        metrics = list(DEFAULT_METRICS)
    launcher = raw.get("launcher")
    if launcher is not None and not isinstance(launcher, dict):
        problems.append(f"launcher: expected a mapping of {list(LAUNCHER_OPTIONS)}, got {launcher!r}")
    exp = Experiment(
        path=path,
        name=name,
        description=_text(raw.get("description"), "description", problems),
        base=base,
        common=common,
        seeds=seeds,
        baseline=str(baseline),
        variants={v.name: v for v in variants if v is not None},
        output=(root / output).resolve() if output else None,
        report_metrics=metrics,
        launcher=checked_options(launcher, LAUNCHER_OPTIONS, "launcher", problems)
        if isinstance(launcher, dict)
        else {},
    )
    return exp, problems


def load_experiment(path: str | Path) -> Experiment:
    """Read an experiment file, raising :class:`ExperimentError` with every structural problem."""
    exp, problems = parse_experiment(path)
    if problems or exp is None:
        raise ExperimentError(path, problems)
    return exp


def load_config(path: str | Path) -> Any:
    """One YAML config file as an OmegaConf mapping; ValueError naming a file not YAML or not a mapping."""
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    return cfg


def merge(files: list[Path], *mappings: dict[str, Any], skip_missing: bool = False) -> dict[str, Any]:
    """Config files deep-merged in order, then the mappings (lists are replaced)."""
    files = [p for p in files if p.is_file()] if skip_missing else files
    layers = [load_config(p) for p in files] + [OmegaConf.create(m) for m in mappings]
    return OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True)  # type: ignore[return-value]


RUN_NAME_ARG = {"WandbLogger": "name", "MLFlowLogger": "run_name"}  # each run is named VARIANT/seedK there


def _class_name(entry: Any) -> str:
    return entry.get("class_path", "").rsplit(".", 1)[-1] if isinstance(entry, dict) else ""


def _as_list(entries: Any) -> list[Any]:
    return entries if isinstance(entries, list) else [entries] if isinstance(entries, dict) else []


def run_config(cfg: dict[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    """The config one run trains with: ``cfg`` plus the runner's seed, log and checkpoint directories."""
    cfg = json.loads(json.dumps(cfg))  # a deep copy of plain containers
    run_dir = Path(run_dir).resolve()
    cfg["seed_everything"] = seed
    trainer = cfg["trainer"] = cfg.get("trainer") or {}
    trainer["default_root_dir"] = str(run_dir)
    trainer["enable_progress_bar"] = False
    trainer["enable_checkpointing"] = True  # the summary reads the model's hyperparameters from last.ckpt
    loggers = trainer.get("logger")
    if loggers is True:  # Lightning's default logger, made explicit so that it can be moved into the run
        loggers = [{"class_path": "pytorch_lightning.loggers.TensorBoardLogger"}]
    loggers = _as_list(loggers)
    if not any(_class_name(lg) == "CSVLogger" for lg in loggers):
        loggers.insert(0, {"class_path": "pytorch_lightning.loggers.CSVLogger", "init_args": {}})
    for lg in loggers:  # every configured logger is kept (W&B, MLflow, ...); the report reads the CSV one
        name = _class_name(lg)
        if name in ("CSVLogger", "TensorBoardLogger"):
            lg.setdefault("init_args", {}).update(save_dir=str(run_dir), name="logs", version=0)
        elif name in RUN_NAME_ARG:
            init = lg.setdefault("init_args", {})
            init.setdefault(RUN_NAME_ARG[name], f"{run_dir.parent.name}/{run_dir.name}")
    trainer["logger"] = loggers
    callbacks = [cb for cb in _as_list(trainer.get("callbacks")) if _class_name(cb) != "TrainClock"]
    if not any(_class_name(cb) == "ModelCheckpoint" for cb in callbacks):
        callbacks.append({"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {}})
    for cb in callbacks:
        if _class_name(cb) == "ModelCheckpoint":
            cb.setdefault("init_args", {}).update(dirpath=str(run_dir / "ckpt"), save_last=True)
    trainer["callbacks"] = [*callbacks, {"class_path": "rlm.experiment.timing.TrainClock"}]
    return cfg


def flatten(mapping: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a nested mapping as (dotted.key, value); an empty mapping is a leaf."""
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def unflatten(dotted: str, value: Any) -> dict[str, Any]:
    """``a.b.c`` and a value as the nested mapping {a: {b: {c: value}}}."""
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write a text file under a temporary name, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def apply_overrides(
    exp: Experiment, sets: list[str], seeds: list[int] | None, problems: list[str], base: list[str] | None
) -> None:
    """Command-line ``--set a.b=VALUE`` (merged into ``common``, VALUE read as YAML), ``--seeds``, and
    ``--base FILE`` (config files appended to the file's ``base``, relative to the working directory)."""
    exp.base = [*exp.base, *_paths(base, "--base", Path.cwd(), problems)]
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            problems.append(
                f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. trainer.max_steps=100"
            )
            continue
        try:
            exp.common = merge([], exp.common, unflatten(key, yaml.safe_load(value)))
        except yaml.YAMLError as err:
            problems.append(f"--set {item!r}: the value is not valid YAML: {err}")
    if seeds:
        exp.seeds = _seeds(list(seeds), problems)
