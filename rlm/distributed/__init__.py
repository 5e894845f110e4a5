"""Parallelism applied from outside the model: FSDP2 sharding and plain copies of sharded parts (``parallel``),
the gradients rlm reduces itself for parameters whole on every rank (``replicas``), and the run's layout as a
plugin asks for it, read from Lightning's strategy (``layout``).

Sits below the plugins and above the core: a plugin that holds sharded parts or replicated parameters uses these
helpers, and rlm.train applies them. Imports the core only (rlm.plugin, for the plugins' parameter lists); never
a plugin, rlm.train or above. Nothing is imported here: ``import rlm.distributed`` imports no torch.
"""
