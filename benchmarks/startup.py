"""Start-up time of the ``rlm`` command: each command line in a fresh interpreter, best of --repeat.

    python benchmarks/startup.py [--repeat 3] [--experiment configs/experiments/pkm.yaml]

The light commands (``--help``, ``plugins``, ``plugins NAME``, which reads a built-in's options from its source,
the help of ``eval``, ``generate`` and ``index``, ``experiment status``, an ``experiment check`` of a file that
fails its structure pass) import neither torch nor Lightning. ``fit --help`` is LightningCLI's: its first build
imports both, and it is the baseline the ratios are taken against (timed with an empty $RLM_CACHE each run); later
calls print the text that build kept (``fit --help, kept``). ``experiment check FILE`` of a valid file parses every variant with the ``rlm fit`` parser
and builds each model on the meta device, so it costs at least what ``fit --help`` does. The load average is
printed before and after: on a shared machine the times grow with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start_time(args: list[str], repeat: int, cache: Path | None = None) -> float:
    """Best wall-clock seconds of ``python -m rlm ARGS`` over ``repeat`` runs (best: the least disturbed); with
    ``cache``, each run gets an empty RLM_CACHE under it (nothing kept from an earlier run)."""
    times = []
    for i in range(repeat):
        env = {**os.environ, "RLM_CACHE": str(cache / str(i))} if cache else None
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "rlm", *args], capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if run.returncode != (
            2 if args[-1].endswith("bad.yaml") else 0
        ):  # a crash would time as a fast start
            raise SystemExit(f"rlm {' '.join(args)}: exit {run.returncode}\n{run.stderr[-2000:]}")
    return min(times)


def commands(experiment: str, work: Path) -> list[list[str]]:
    """The command lines timed; ``work`` receives an experiment directory for ``status`` and a bad file."""
    from rlm.experiment.spec import load_experiment

    (work / "out").mkdir()
    (work / "out" / "experiment.json").write_text(json.dumps(load_experiment(experiment).to_json()))
    (work / "bad.yaml").write_text("variants: [a, b]\n")
    return [
        ["--help"],
        ["plugins"],
        ["plugins", "pkm"],
        ["plugins", "moe"],
        ["plugins", "retrieval"],
        ["eval", "--help"],
        ["generate", "--help"],
        ["index", "--help"],
        ["experiment", "check", "--help"],
        ["experiment", "status", str(work / "out")],
        ["experiment", "check", str(work / "bad.yaml")],
        ["experiment", "check", experiment],
        ["fit", "--help"],  # with the text kept by an earlier call (main times its first build apart)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="runs per command; the best is reported")
    p.add_argument("--experiment", default="configs/experiments/pkm.yaml",
                   help="the experiment file `experiment check` and `status` read (default: %(default)s)")  # fmt: skip
    a = p.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        lines = commands(a.experiment, Path(work))
        built = start_time(["fit", "--help"], a.repeat, Path(work) / "fresh")  # every run builds the parser
        subprocess.run([sys.executable, "-m", "rlm", "fit", "--help"], capture_output=True)  # keeps its text
        seconds = {" ".join(c).replace(work, "TMP"): start_time(c, a.repeat) for c in lines}
    seconds["fit --help, kept"] = seconds.pop("fit --help")
    seconds["fit --help, first build"] = base = built
    print(f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} cores")
    print("| command | seconds | / fit --help |\n|---|---:|---:|")
    for name, s in seconds.items():
        print(f"| rlm {name} | {s:.2f} | {s / base:.2f} |")


if __name__ == "__main__":
    main()
