"""rlm: retrieval-augmented language models with memory plugins.

Packages import only their own layer and those below, lowest first: the core (rlm.model, rlm.data, rlm.plugin,
rlm.extras); rlm.index and rlm.distributed; the plugins; rlm.train; rlm.eval; rlm.cli's plumbing; the
subcommands (rlm.experiment, rlm.index.cli); the command table. tests/model/test_layering.py checks it.
"""

__version__ = "0.1.0"
