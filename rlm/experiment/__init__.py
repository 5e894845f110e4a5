"""Experiments: train several variants of a model with several seeds, then tabulate and plot them.

``rlm experiment run FILE`` trains every (variant, seed) of an experiment file, each an ordinary ``rlm fit``
subprocess, resumably, here or as SLURM jobs (``submit``); ``check`` validates the file and prints the plan
(``check``); ``report`` rebuilds the tables and plots (``report``, ``plots``, both reading ``results``);
``status`` shows each run's state. The file format and the output layout: docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported when asked for (PEP 562): `rlm experiment status` and `--help` import no torch or Lightning.
_NAMES = {
    "Experiment": "rlm.experiment.spec",
    "ExperimentError": "rlm.experiment.spec",
    "Variant": "rlm.experiment.spec",
    "load_experiment": "rlm.experiment.spec",
    "TrainClock": "rlm.experiment.timing",
}

__all__ = ["Experiment", "ExperimentError", "TrainClock", "Variant", "load_experiment"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'rlm.experiment' has no attribute {name!r}")
