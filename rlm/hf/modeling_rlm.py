"""The code transformers runs for an exported rlm model with plugins, ``trust_remote_code=True`` (``rlm export``
copies this file into the folder): the folder's copy of rlm's source (``rlm_src/``) goes on the import path and
rlm.hf.model takes over. Nothing of rlm is imported at the top: transformers checks that every package a remote
file imports is installed, and rlm need not be.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel

SOURCE = "rlm_src"


def _local(path: str | os.PathLike[str]) -> str:
    """The local folder of a model: ``path`` itself, or the downloaded snapshot of a Hub repository."""
    if os.path.isdir(path):
        return str(path)
    from huggingface_hub import snapshot_download

    return snapshot_download(str(path))


def _rlm_hf(folder: str) -> Any:
    """rlm.hf.model, from the folder's own source unless rlm is imported already."""
    source = os.path.join(folder, SOURCE)
    if "rlm" not in sys.modules and os.path.isdir(source) and source not in sys.path:
        sys.path.insert(0, source)
    return importlib.import_module("rlm.hf.model")


def _handed_over(name: str) -> classmethod:
    """A from_pretrained that loads the folder's rlm.hf.model.<name> instead."""

    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
    ):
        folder = _local(pretrained_model_name_or_path)
        return getattr(_rlm_hf(folder), name).from_pretrained(folder, *args, **kwargs)

    return classmethod(from_pretrained)


class RLMConfig(PretrainedConfig):
    """Loads as rlm.hf.model.RLMConfig (rlm's ModelConfig and every plugin's options)."""

    model_type = "rlm"
    from_pretrained = _handed_over("RLMConfig")


class RLMForCausalLM(PreTrainedModel, GenerationMixin):
    """Loads as rlm.hf.model.RLMForCausalLM (rlm's Transformer with its plugins; generate() over rlm's cache)."""

    config_class = RLMConfig
    from_pretrained = _handed_over("RLMForCausalLM")
