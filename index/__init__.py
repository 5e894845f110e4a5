"""Retrieval indices (installed as rlm.index): build, search with causal filters, narrow (PCA), store, shard and
merge.

index/ knows nothing of plugins; it reaches embedders through the Embedder protocol. It imports only the core
(rlm.data, rlm.plugin's Context, rlm.extras); its command line, rlm.index.cli, also loads checkpoints
(rlm.train) and checks output folders (rlm.cli.check).
"""
