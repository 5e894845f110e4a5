"""Using a trained checkpoint: ``evaluate`` (``rlm eval``), ``generate`` (sampling), ``harness`` (lm-eval), and
kNN-LM: ``datastore`` (build and load), ``knnlm`` (interpolation), ``knnlm_cli`` (``rlm knnlm``).

May import rlm.train, rlm.index and the core; never a concrete plugin, rlm.cli or rlm.experiment. Nothing is
imported here: ``import rlm.eval`` imports no torch.
"""
