"""Using a trained checkpoint: ``evaluate`` (``rlm eval``, and the settings ``rlm validate|test`` restore) and
``generate`` (sampling).

May import rlm.train, rlm.index and the core (rlm.model, rlm.data, rlm.plugin: never a concrete plugin;
rlm.extras); never rlm.cli or rlm.experiment. Nothing is imported here: ``import rlm.eval`` imports no torch.
"""
