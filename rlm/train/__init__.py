"""Training: the LightningModule, crash-safe checkpoints, resuming, the non-finite guard, throughput, strategy."""
