"""Retrieval indices (installed as rlm.index): build, search with causal filters, narrow, store, shard. It knows
no plugin: embedders come in through the Embedder protocol (protocol.py)."""
