"""Parallelism applied from outside the model: FSDP2 sharding and plain copies of sharded parts (``parallel``),
the gradients rlm reduces itself for parameters whole on every rank (``replicas``), and the run's layout read from
Lightning's strategy (``layout``). Below the plugins, above the core; imports nothing, so no torch.
"""
