"""torch.compile applied per transformer block, after the strategy's parallelism.

``LMModule(compile=...)`` used to compile the whole model in its constructor, before ``configure_model`` sharded
the blocks with FSDP2, so the one graph was traced around FSDP's per-block hooks. Now ``configure_model`` shards
first (under ModelParallelStrategy) and then compiles each block in place, on one process and under every
strategy alike (one code path):

- the unit FSDP2 all-gathers is the unit compiled: FSDP's hooks around a block run eagerly (torch marks them
  ``_dynamo_disable``), and a block's graph holds only its own compute;
- the embedding, the stack slot's loop (AltUp's predict / correct), the head and the loss stay eager, where the
  plugins' ``prepare`` and the per-step context live;
- what plugins keep out of the graph today (``torch.compiler.disable`` on MoE's dispatch and PKM's search and
  value read) stays out the same way: it is inside the blocks, behind its own graph breaks;
- in place (``nn.Module.compile``): parameter names, and so checkpoints, are those of the eager model.

Under DDP, Lightning wraps the module after ``configure_model``; compilation is lazy, so every block is traced
on its first call, inside DDP's forward, where Dynamo's DDP optimizer sees the wrapper as it would for a model
compiled after wrapping.
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
    """A torch.compile backend by name: 'inductor' (generated kernels), or 'aot_eager' / 'eager' (traced, no code
    generated: cheap, for tests and for telling a tracing problem from a code-generation one)."""
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
    """Compile every block of ``model`` (a Transformer) in place; blocks already compiled are left as they are
    (``configure_model`` may be called twice)."""
    for block in model.blocks:
        if not is_compiled(block):
            block.compile(backend=config.backend, mode=config.mode)
