"""Parallelism applied from outside the model: FSDP2 sharding, the gradients rlm reduces itself, the run's layout."""
