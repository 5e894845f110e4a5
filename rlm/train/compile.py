"""torch.compile per transformer block, in place after FSDP2 has sharded the blocks: the unit FSDP2 all-gathers is
the unit compiled, FSDP's hooks run eagerly, and parameter names and checkpoints stay the eager model's. The
embedding, the stack's loop, the head and the loss stay eager, where plugins' ``prepare`` and the context live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class CompileConfig:
    """How each transformer block is compiled (``torch.compile``'s backend and mode)."""

    backend: str = "inductor"
    """A torch.compile backend: 'inductor', or 'aot_eager' / 'eager' (traced, no code generated)."""
    mode: str | None = None
    """Inductor's mode ('default', 'reduce-overhead', 'max-autotune', ...); None: Inductor's default."""

    def __post_init__(self) -> None:
        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.backend not in backends:
            raise ValueError(
                f"compile.backend {self.backend!r} is not a torch.compile backend; one of {backends}"
            )
        if self.mode is not None:
            if self.backend != "inductor":
                raise ValueError(
                    f"compile.mode {self.mode!r} is Inductor's; backend {self.backend!r} takes none"
                )
            modes = sorted(torch._inductor.list_mode_options())
            if self.mode not in modes:
                raise ValueError(f"compile.mode {self.mode!r} is not one of Inductor's modes {modes}")


def compile_config(value: bool | CompileConfig | dict[str, Any] | None) -> CompileConfig | None:
    """LMModule's ``compile`` option as a config: True -> Inductor's defaults, False / None -> not compiled."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileConfig()
    if isinstance(value, CompileConfig):
        return value
    if isinstance(value, dict):
        return CompileConfig(**value)
    raise ValueError(f"compile must be true, false or {{backend, mode}}, got {value!r}")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile``)."""
    return module._compiled_call_impl is not None


def compile_blocks(model: nn.Module, config: CompileConfig) -> None:
    """Compile every block of a Transformer in place, skipping compiled ones (``configure_model`` may run twice)."""
    for block in model.blocks:
        if not is_compiled(block):
            block.compile(backend=config.backend, mode=config.mode)
