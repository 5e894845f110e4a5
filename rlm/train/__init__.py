"""Training: the LightningModule, crash-safe checkpoints, resuming, the non-finite guard, throughput and
strategy checks. Imports nothing, so ``import rlm.train`` imports no torch; rlm.distributed shards from outside.
"""
