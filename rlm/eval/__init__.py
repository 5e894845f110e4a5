"""Using a trained checkpoint: ``evaluate`` (``rlm eval``, and the settings ``rlm validate|test`` restore),
``generate`` (sampling), and kNN-LM: ``datastore`` (build and load a checkpoint's token datastore),
``knnlm`` (interpolating the LM with its neighbours) and ``knnlm_cli`` (``rlm knnlm``, ``rlm eval --datastore``).

May import rlm.train, rlm.index and the core (rlm.model, rlm.data, rlm.plugin: never a concrete plugin;
rlm.extras); never rlm.cli or rlm.experiment. Nothing is imported here: ``import rlm.eval`` imports no torch.
"""
