"""Training: the LightningModule (``module``), crash-safe checkpoints, resuming, the non-finite guard,
throughput, strategy checks and the FSDP2 sharding applied from outside the model (``parallel``).

May import rlm.model, rlm.plugin (the contract, never a concrete plugin), rlm.data and rlm.extras; never
rlm.cli, rlm.eval, rlm.experiment or rlm.index. ``parallel`` imports nothing from rlm, so a plugin that holds
sharded parts may use its tensor helpers. Nothing is imported here: ``import rlm.train`` imports no torch.
"""
