"""rlm: retrieval-augmented language models with memory plugins."""

__version__ = "0.1.0"
