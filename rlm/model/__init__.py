"""The core transformer, its named slots, and their filling with plugins (``assemble``)."""

from rlm.model.config import ModelConfig
from rlm.model.transformer import Block, Transformer

__all__ = ["Block", "ModelConfig", "Transformer"]
