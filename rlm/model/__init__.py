"""The core transformer and its named slots, and the filling of the slots with plugins (``assemble``).

Core layer: imports rlm.plugin (the contract and the registry, never a concrete plugin) and nothing else of
rlm. ``transformer`` calls ``assemble``, never the other way.
"""

from rlm.model.config import ModelConfig
from rlm.model.transformer import Block, Transformer

__all__ = ["Block", "ModelConfig", "Transformer"]
