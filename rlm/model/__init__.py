"""The core transformer."""

from rlm.model.config import ModelConfig
from rlm.model.transformer import Block, Transformer

__all__ = ["Block", "ModelConfig", "Transformer"]
