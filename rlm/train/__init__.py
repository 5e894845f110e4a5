"""Training: the LightningModule (``module``), crash-safe checkpoints, resuming, the non-finite guard,
throughput, strategy checks and the FSDP2 sharding applied from outside the model (``parallel``).

May import the core (rlm.model, rlm.data, rlm.plugin: the contract, never a concrete plugin; rlm.extras) and
rlm.index; never rlm.eval, rlm.cli or rlm.experiment. ``parallel`` imports nothing of rlm and sits lower, so a
plugin that holds sharded parts may use its tensor helpers. ``module`` uses ``diff`` and ``resume`` uses both,
one way. Nothing is imported here: ``import rlm.train`` imports no torch.
"""
