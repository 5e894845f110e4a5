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


def _handed_over(name: str) -> classmethod:
    """A from_pretrained that loads rlm.hf.model.<name>, from the folder's own source unless rlm is imported."""

    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
    ):
        folder = str(pretrained_model_name_or_path)
        if not os.path.isdir(folder):  # a Hub repository: its downloaded snapshot
            from huggingface_hub import snapshot_download

            folder = snapshot_download(folder)
        source = os.path.join(folder, "rlm_src")
        if "rlm" not in sys.modules and os.path.isdir(source) and source not in sys.path:
            sys.path.insert(0, source)
        return getattr(importlib.import_module("rlm.hf.model"), name).from_pretrained(folder, *args, **kwargs)

    return classmethod(from_pretrained)


class RLMConfig(PretrainedConfig):
    """Loads as rlm.hf.model.RLMConfig (rlm's ModelConfig and every plugin's options)."""

    model_type = "rlm"
    from_pretrained = _handed_over("RLMConfig")


class RLMForCausalLM(PreTrainedModel, GenerationMixin):
    """Loads as rlm.hf.model.RLMForCausalLM (rlm's Transformer with its plugins; generate() over rlm's cache)."""

    config_class = RLMConfig
    from_pretrained = _handed_over("RLMForCausalLM")
