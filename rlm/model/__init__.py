"""The core transformer, its named slots, and their filling with plugins (``assemble``); imports of rlm only
rlm.plugin's contract and registry.
"""

from rlm.model.config import ModelConfig
from rlm.model.transformer import Block, Transformer

__all__ = ["Block", "ModelConfig", "Transformer"]
