"""Experiments: train several variants of a model with several seeds, each an ordinary ``rlm fit`` subprocess,
then tabulate and plot them. Commands, file format and output layout: docs/EXPERIMENTS.md."""
