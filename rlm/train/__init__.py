"""Training: the LightningModule (``module``), crash-safe checkpoints, resuming, the non-finite guard,
throughput and strategy checks; the FSDP2 sharding it applies from outside the model is rlm.distributed.

May import the core (rlm.model, rlm.data, rlm.plugin: the contract, never a concrete plugin; rlm.extras),
rlm.index and rlm.distributed; never rlm.eval, rlm.cli or rlm.experiment. ``module`` uses ``diff`` and
``resume`` uses both, one way. Nothing is imported here: ``import rlm.train`` imports no torch.
"""
