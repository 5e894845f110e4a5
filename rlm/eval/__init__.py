"""Using a trained checkpoint: evaluation (``rlm eval``, lm-eval), sampling and kNN-LM (``rlm knnlm``). May import
rlm.train, rlm.index and the core; never a concrete plugin, rlm.cli or rlm.experiment. ``import rlm.eval`` imports
no torch.
"""
