"""rlm: retrieval-augmented language models with memory plugins. Packages import only their own layer and those
below (tests/model/test_layering.py lists the layers and checks it)."""

__version__ = "0.1.0"
