"""Experiments: train several variants of a model with several seeds, then tabulate and plot them.

``rlm experiment run FILE`` trains every (variant, seed) of an experiment file, each an ordinary ``rlm fit``
subprocess, resumably, here or as SLURM jobs (``submit``); ``check`` validates the file and prints the plan;
``report`` rebuilds the tables and plots; ``status`` shows each run's state. The file format and the output
layout: docs/EXPERIMENTS.md.
"""
