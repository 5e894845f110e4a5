"""rlm's Transformer, with its plugins, as a ``transformers`` causal LM (model_type 'rlm').

:class:`RLMConfig` carries rlm's ModelConfig and every plugin's options, from which :class:`RLMForCausalLM` builds
the very same Transformer (the checkpoint's parameter names); ``generate`` decodes as ``rlm generate`` does. No
padding mask, as in training: a right-padded batch scores exactly, a left-padded one does not. A retriever's index
is a folder beside the weights (``indices``); ``manifest.json`` seals every other file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import asdict, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlm.checksums import check_sealed, read_manifest, seal
from rlm.extras import require

require("transformers", "hf-export", "rlm.hf (a transformers model of rlm checkpoints)")

import transformers  # noqa: E402
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.utils import CONFIG_NAME  # noqa: E402

from rlm.model.config import ModelConfig  # noqa: E402
from rlm.model.transformer import Transformer  # noqa: E402
from rlm.plugin.cache import KVCache, refill_start  # noqa: E402
from rlm.plugin.context import Context  # noqa: E402

MODEL_TYPE = "rlm"
MANIFEST = "manifest.json"
WHAT = "exported rlm model"


def write_manifest(folder: Path, indices: dict[str, str | None]) -> None:
    """Write ``folder``'s manifest.json: every file under it but the manifest and the ``indices`` folders."""
    skip = [folder / rel for rel in indices.values() if rel is not None]
    names = [
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST and not any(p.is_relative_to(s) for s in skip)
    ]
    (folder / MANIFEST).write_text(json.dumps(seal(folder, {}, MANIFEST, names), indent=1) + "\n")


def check_manifest(folder: Path, only: str | None = None) -> None:
    """OSError naming the file and ``folder`` if a file its manifest lists (``only`` that one) is gone or changed."""
    meta = read_manifest(folder, MANIFEST, WHAT, OSError)
    check_sealed(folder, meta, MANIFEST, WHAT, "export it again with rlm export", OSError, only=only)


class RLMConfig(PretrainedConfig):
    """The transformers config of an rlm model: rlm's ModelConfig and the plugins' options, verbatim."""

    model_type = MODEL_TYPE

    rlm_model: dict[str, Any] = field(default_factory=dict)  # rlm.model.ModelConfig's fields
    plugins: dict[str, Any] = field(default_factory=dict)  # label -> {class_path, init_args}, every option
    indices: dict[str, str | None] = field(default_factory=dict)  # label -> its index folder, or None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True  # generate() over rlm's key/value cache (WindowCache); False: recompute the window
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        folder = kwargs.get("name_or_path")
        # AutoConfig reads config.json before from_pretrained can check the folder: an edited value (a key of
        # rlm_model, a plugin option) is caught here, not as a TypeError or a silently different model
        if folder and os.path.isfile(os.path.join(folder, MANIFEST)):
            check_manifest(Path(folder), only=CONFIG_NAME)
        if self.rlm_model:  # the standard names, for tools that read them, always from rlm's own config
            shape = ModelConfig(**self.rlm_model)
            self.vocab_size, self.hidden_size = shape.vocab_size, shape.d_model
            self.num_hidden_layers, self.num_attention_heads = shape.n_layers, shape.n_heads
            self.max_position_embeddings = shape.max_seq_len
            self.tie_word_embeddings = shape.tie_embeddings
        super().__post_init__(**kwargs)


class WindowCache(KVCache):
    """rlm's KVCache as generate() carries it between steps: one window of the sequence, from position ``start``."""

    is_compileable = False

    def __init__(self, capacity: int, batch: int, device: torch.device, start: int) -> None:
        super().__init__(capacity, batch, device)
        self.start = start

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens of the sequence up to the cache's end (transformers' name)."""
        return self.start + self.length


class RLMForCausalLM(PreTrainedModel, GenerationMixin):
    """rlm's Transformer with its plugins behind the transformers causal-LM interface (logits, shifted loss,
    greedy and sampled generate(), with rlm's key/value cache or without one)."""

    config_class = RLMConfig
    base_model_prefix = "model"

    def __init__(self, config: RLMConfig) -> None:
        super().__init__(config)
        self.model = Transformer(ModelConfig(**config.rlm_model), config.plugins or None)
        # from_pretrained sets name_or_path before building: the folder that indices are relative to
        if config.name_or_path and os.path.isdir(config.name_or_path):
            self.attach_indices(config.name_or_path)
        # transformers loads parameters one by one, which breaks rlm's tie of head and table: declare it
        params = self.model.named_parameters(remove_duplicate=False)
        source = next((n for n, p in params if p is self.model.head.weight and n != "head.weight"), None)
        self._tied_weights_keys = {"model.head.weight": f"model.{source}"} if source else None
        if source:  # not in model.safetensors: tied again on load
            self._keys_to_ignore_on_load_missing = [r"^model\.head\.weight$"]
        self.post_init()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Tensors only: a retriever's index folder (its extra state) travels in config.json's ``indices``."""
        full = super().state_dict(*args, **kwargs)
        for key in [k for k, v in full.items() if not isinstance(v, Tensor)]:
            del full[key]
        return full

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As nn.Module's, with plugins' extra state optional."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {result.unexpected_keys}")
        return result

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No: generate() carries rlm's own WindowCache."""
        return False

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """Only the non-persistent buffers that from_pretrained leaves empty (rotary tables, hash constants)."""
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    def get_input_embeddings(self) -> torch.nn.Module:
        """The token embedding (transformers' name)."""
        return self.model.embed.main

    def get_output_embeddings(self) -> torch.nn.Module:
        """The LM head (transformers' name)."""
        return self.model.head

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
    ):
        """transformers' from_pretrained, a local folder checked against its manifest first."""
        if os.path.isdir(pretrained_model_name_or_path):
            check_manifest(Path(pretrained_model_name_or_path))
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        # __init__ attached a local folder's indices: from_pretrained sets name_or_path before building
        indexed = any(rel is not None for rel in (model.config.indices or {}).values())
        if indexed and not os.path.isdir(pretrained_model_name_or_path):
            warnings.warn(
                f"{pretrained_model_name_or_path!r} is not a local folder, so its retrieval index "
                f"{model.config.indices} is not loaded and the retriever runs without neighbours; download the "
                "folder and load it from there, or call model.attach_indices(folder)",
                stacklevel=2,
            )
        return model

    def save_pretrained(
        self, save_directory: str | os.PathLike[str], is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """transformers' save_pretrained, then the folder's manifest.json (which from_pretrained checks)."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            write_manifest(Path(save_directory), self.config.indices or {})

    def attach_indices(self, root: str | os.PathLike[str]) -> None:
        """Point each retriever at its exported index folder under ``root`` (loaded on its first forward)."""
        for label, rel in (self.config.indices or {}).items():
            if rel is not None:
                self.model.plugins[label].set_extra_state({"index_dir": str(Path(root, rel).resolve())})

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        return_dict: bool | None = None,
        cache: WindowCache | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple[Tensor, ...]:
        """Logits (B, T, V); with ``labels`` (B, T) also the mean next-token loss (labels shifted here, -100
        ignored), plus the plugins' auxiliary losses in training. With ``cache``, ``input_ids`` follow its tokens."""
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        ctx = Context(tokens=input_ids, mask=mask, stage="train" if self.training else "predict")
        for plugin in self.model.plugins.values():  # as LMModule.make_context does
            plugin.prepare(ctx, {"tokens": input_ids, "mask": mask})
        if cache is not None:
            ctx.cache, ctx.offset = cache, cache.length
        logits = self.model(input_ids, ctx)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
            aux = ctx.total_aux_loss() if self.training else None
            loss = loss if aux is None else loss + aux
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: WindowCache | None = None,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The next forward's inputs, as rlm.eval.generate builds them: with the cache, the tokens it has not
        seen (re-filled past max_seq_len by refill_start); without it, the last max_seq_len tokens."""
        window = self.model.config.max_seq_len
        if use_cache is None:
            use_cache = self.config.use_cache
        if not use_cache:
            out = {"input_ids": input_ids[:, -window:]}
            if attention_mask is not None:
                out["attention_mask"] = attention_mask[:, -window:]
            return out
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "generate(use_cache=True) of an rlm model takes prompts of one length (no padding: the cache has "
                "no padding mask); give prompts of equal length, or use_cache=False"
            )
        start = refill_start(input_ids.shape[1], cache.start if cache is not None else 0, window)
        if cache is None or start != cache.start:
            cache = WindowCache(window, input_ids.shape[0], input_ids.device, start)
        return {"input_ids": input_ids[:, start + cache.length :], "cache": cache}


def plugin_specs(model: Transformer) -> dict[str, Any]:
    """Every plugin of a built model as ``{label: {class_path, init_args}}`` with all its options."""
    specs = {}
    for label, plugin in model.plugins.items():
        cls = type(plugin)
        if not dataclasses.is_dataclass(plugin.config):
            raise ValueError(
                f"plugin {label!r} ({cls.__qualname__}): its config {type(plugin.config).__name__} is not a "
                "dataclass, so its options cannot be written to config.json; accepted: a dataclass Config"
            )
        specs[label] = {
            "class_path": f"{cls.__module__}.{cls.__qualname__}",
            "init_args": asdict(plugin.config),
        }
    return specs


# model_type 'rlm' for AutoConfig and AutoModelForCausalLM: exported folders load without remote code
transformers.AutoConfig.register(MODEL_TYPE, RLMConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(RLMConfig, RLMForCausalLM, exist_ok=True)
