"""Start-up time of the ``rlm`` command: each command line in a fresh interpreter, best of --repeat.

    python benchmarks/startup.py [--repeat 3]

The light commands (``--help``, ``plugins``, the help of ``eval`` and ``generate``) import neither torch nor
Lightning; ``fit --help`` is LightningCLI's and imports both, so it is the baseline the ratios are taken against.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

COMMANDS = [["--help"], ["plugins"], ["eval", "--help"], ["generate", "--help"], ["fit", "--help"]]


def start_time(args: list[str], repeat: int) -> float:
    """Best wall-clock seconds of ``python -m rlm ARGS`` over ``repeat`` runs (best: the least disturbed)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rlm", *args], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="runs per command; the best is reported")
    a = p.parse_args()
    seconds = {" ".join(c): start_time(c, a.repeat) for c in COMMANDS}
    base = seconds["fit --help"]
    print("| command | seconds | / fit --help |\n|---|---:|---:|")
    for name, s in seconds.items():
        print(f"| rlm {name} | {s:.2f} | {s / base:.2f} |")


if __name__ == "__main__":
    main()
