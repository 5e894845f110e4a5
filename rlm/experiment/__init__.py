"""Experiments: train several variants of a model with several seeds, then tabulate and plot them.

``rlm experiment run FILE`` trains every (variant, seed) of an experiment file, each an ordinary ``rlm fit``
subprocess, skipping runs that already finished: one after another, ``--jobs N`` at once on this machine, or
as SLURM jobs (``--launcher slurm``, through submitit: rlm.experiment.submit); ``rlm experiment check FILE``
validates the file and prints the plan with each variant's parameter counts, training nothing; ``rlm
experiment report DIR`` rebuilds the tables and plots from the finished runs in DIR; ``rlm experiment status
DIR`` shows which runs are pending, queued, running, done, stopped or failed.

The experiment file (YAML; every path in it is relative to the file itself)::

    name: lookups              # optional, default: the file's stem; names the output directory
    description: |             # optional: what the experiment asks and what the paper found
      ...
    base: [../default.yaml]    # config files every run starts from, deep-merged in order (rlm fit --config)
    common:                    # optional mapping merged into every run after the variant's configs
      trainer: {max_steps: 300}
    seeds: [0, 1]              # optional, default [0]; each run sets seed_everything to its seed
    baseline: baseline         # the variant the others are compared with (default: the first variant)
    output: ../../runs/x       # optional output directory (default: runs/experiments/NAME under the cwd)
    report_metrics: ["val/*"]  # optional fnmatch patterns of the plugin metrics shown in results.md
    variants:                  # name -> what differs from the base; {} or null is the base itself
      baseline: {}
      tokenid:
        description: ...       # optional, one line shown in results.md
        configs: [../plugins/tokenid.yaml]                 # config fragments stacked after base
        set: {model: {plugins: {tokenid: {rank: 0}}}}      # a config mapping merged last
    launcher:                  # optional: where the runs execute (rlm.experiment.launcher.LAUNCHER_OPTIONS)
      name: slurm              # local (default), slurm, or submitit-local (the slurm jobs on this machine)
      jobs: 1                  # local: runs at once (one GPU each when there are GPUs)
      partition: gpu           # slurm: partition, gpus_per_job (1), cpus_per_job, mem_gb, time (required),
      time: "12:00:00"         # requeue (true), signal_delay_s (120), account, qos, constraint, setup

A run's config is, deep-merged in this order (mappings merge key by key, lists are replaced):
``base`` files, the variant's ``configs``, ``common``, the variant's ``set``, and finally the runner's own
keys: ``seed_everything``, the log and checkpoint directories (every logger's ``save_dir`` and every
``ModelCheckpoint``'s ``dirpath`` point into the run directory, a CSVLogger and a last-checkpoint are added
when missing, checkpointing is on; other loggers such as W&B or MLflow are kept, each run named
``VARIANT/seedK`` there), no progress bar, and the :class:`TrainClock` callback that logs
``time/train_s`` and ``time/load`` (the machine's load average, printed beside each run's throughput). ``rlm experiment run --set KEY=VALUE`` merges into ``common`` and ``--seeds`` replaces the
seeds, for a smaller budget (give such runs their own ``--out``); ``--base FILE`` appends config files to
``base`` (another model size). Flags such as ``--launcher``, ``--jobs``, ``--partition`` and ``--time``
override the ``launcher`` mapping, which is not part of any run's config. The data split (``data.seed``) is not varied with the seed, so every run is validated on the same documents.

Layout of the output directory: ``experiment.json`` (the resolved experiment), ``results.csv``,
``results.md``, ``val_loss_vs_step.png``, ``val_loss_vs_time.png``, ``loss_vs_added_params.png``, and one
directory per run, ``VARIANT/seedK/``, holding ``config.yaml`` (the merged config it was trained with),
``fit.log`` (the subprocess output), ``job.json`` (where and when it ran, and how it ended; ``status`` reads
it), ``logs/version_0/metrics.csv``, ``ckpt/`` and, once it finished,
``summary.json`` -- the marker that makes a later ``run`` skip it. A run directory without ``summary.json``
is resumed from ``ckpt/last.ckpt`` when its config is unchanged, and started afresh otherwise.

Validation happens before anything trains and lists every problem of the file at once: the file's own
structure, missing config files, plugin specs (:func:`rlm.plugin.registry.validate_specs`), every override
parsed by the real ``rlm fit`` parser, and each variant's model built on the meta device.

Imports rlm.train, rlm.cli's config plumbing (``merge``, ``lightning_cli``: configs are read and checked as
``rlm fit`` reads them) and the core; never rlm.cli.commands, which dispatches here. ``report`` calls
``plots``; both read the runs through ``results``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name is imported when asked for (PEP 562): `rlm experiment status` and `--help` import no torch or Lightning.
_NAMES = {
    "main": "rlm.experiment.cli",
    "Experiment": "rlm.experiment.spec",
    "ExperimentError": "rlm.experiment.spec",
    "Variant": "rlm.experiment.spec",
    "load_experiment": "rlm.experiment.spec",
    "TrainClock": "rlm.experiment.timing",
}

__all__ = ["Experiment", "ExperimentError", "TrainClock", "Variant", "load_experiment", "main"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'rlm.experiment' has no attribute {name!r}")
