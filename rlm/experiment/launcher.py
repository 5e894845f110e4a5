"""Where an experiment's runs execute: the ``launcher`` mapping of an experiment file and the flags that
override it, checked with every problem named, and SLURM's time formats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LAUNCHER_DEFAULTS: dict[str, Any] = {"name": "local", "jobs": 1, "requeue": True, "signal_delay_s": 120}

LAUNCHERS = ("local", "slurm", "submitit-local")
"""local: this machine, ``jobs`` at once; slurm: a SLURM job per run through submitit; submitit-local:
the same jobs on this machine (a dry run of the job path)."""


LAUNCHER_OPTIONS: dict[str, tuple[type, str]] = {
    "name": (str, f"one of {list(LAUNCHERS)}"),
    "jobs": (int, "a positive integer (local: runs at once)"),
    "partition": (str, "a SLURM partition name"),
    "gpus_per_job": (int, "an integer >= 0"),
    "cpus_per_job": (int, "a positive integer"),
    "mem_gb": (float, "a positive number of GB"),
    "time": (
        str,
        "SLURM's formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 90 or '1-12:00:00'",
    ),
    "requeue": (bool, "true or false"),
    "signal_delay_s": (int, "an integer >= 10 (seconds before the time limit when rlm fit is stopped)"),
    "account": (str, "a SLURM account"),
    "qos": (str, "a SLURM quality of service"),
    "constraint": (str, "a SLURM node constraint"),
    "setup": (list, "a list of shell lines run before each job, e.g. ['module load cuda']"),
}


def time_minutes(value: Any) -> int | None:
    """A time limit in whole minutes (seconds round up), read as SLURM reads ``--time``: minutes, MM:SS,
    HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS; None if it is none of these or not positive."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    days, dash, clock = value.strip().rpartition("-")
    parts = clock.split(":")
    if (dash and not days.isdigit()) or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    n = [int(p) for p in parts]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, sec = n + [0] * (3 - len(n))
    elif len(n) == 3:  # HH:MM:SS
        h, m, sec = n
    else:  # MM or MM:SS
        h, m, sec = 0, n[0], n[1] if len(n) == 2 else 0
    if sec >= 60 or (m >= 60 and (days or len(n) == 3)):
        return None
    total = int(days or 0) * 1440 + h * 60 + m + (sec > 0)
    return total if total > 0 else None


def parse_launcher(value: Any, where: str, problems: list[str]) -> dict[str, Any]:
    """A ``launcher`` mapping checked against LAUNCHER_OPTIONS; every bad key or value is a problem."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a mapping of {list(LAUNCHER_OPTIONS)}, got {value!r}")
        return {}
    return checked_options(value, LAUNCHER_OPTIONS, _launcher_ok, where, problems)


def _launcher_ok(key: str, option: Any, kind: type) -> bool:
    number = isinstance(option, (int, float)) and not isinstance(option, bool)
    if key == "name":
        return option in LAUNCHERS
    if key == "time":
        return time_minutes(option) is not None
    if kind is int:
        low = {"jobs": 1, "cpus_per_job": 1, "signal_delay_s": 10}.get(key, 0)
        return number and isinstance(option, int) and option >= low
    if kind is float:
        return number and option > 0
    if kind is list:
        return isinstance(option, list) and all(isinstance(line, str) for line in option)
    return isinstance(option, kind)


def checked_options(
    value: dict[str, Any],
    table: dict[str, tuple[type, str]],
    ok: Callable[[str, Any, type], bool],
    where: str,
    problems: list[str],
) -> dict[str, Any]:
    """The items of ``value`` named in ``table`` (key -> (type, what is accepted)) that ``ok(key, value, type)``
    takes; every other item is a problem naming what is accepted."""
    out: dict[str, Any] = {}
    for key, option in value.items():
        if key not in table:
            problems.append(f"{where}: unknown option {key!r}; accepted: {list(table)}")
        elif not ok(key, option, table[key][0]):
            problems.append(f"{where}.{key}: got {option!r}; accepted: {table[key][1]}")
        else:
            out[key] = option
    return out


def resolve_launcher(from_file: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The launcher options a run uses: defaults, the file's mapping, then the flags (None: not given).
    ValueError naming every bad flag or combination."""
    problems: list[str] = []
    given = {k: v for k, v in flags.items() if v is not None}
    if isinstance(given.get("time"), str) and given["time"].strip().isdigit():
        given["time"] = int(given["time"])
    checked: dict[str, Any] = {}
    for key, value in given.items():  # each message names the flag: --gpus-per-job: got -1; accepted: ...
        mine: list[str] = []
        checked.update(parse_launcher({key: value}, "launcher", mine))
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
