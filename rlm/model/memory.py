"""Memory of a training run estimated from its config alone: parameters, gradients, optimizer state, activations.

Bytes, for bf16-mixed training as Lightning runs it (fp32 master weights, bf16 matmuls under autocast): weights 4 B
per parameter; gradients 4 B per parameter the main optimizer steps (``Parts.row_adam`` tables have no ``.grad``);
AdamW's two fp32 moments 8 B per parameter (a row-wise Adam alike, plus a 4-byte step per table); autocast's bf16
weight copies 2 B per parameter. Activations are what autograd saves for backward, per token and layer for rlm's
pre-norm block with flash attention (no T x T matrix), in the manner of Korthikanti et al. 2022, Sec. 4.1; d the
width, f the FFN hidden width, h the heads, fp32 residual stream, bf16 matmul inputs:

    RMSNorm    4d (input, fp32) + 4 (1/rms) + 4d (normalised input, for the weight's gradient) = 8d + 4
    attention  norm + 2d (qkv input, bf16) + 6d (q, k, v) + 4d (rotated q, k) + 2d (attention output)
               + 4h (log-sum-exp, fp32) + 2d (projection input)                          = 24d + 4h + 4
    FFN        norm + 2d (up input) + 2f (GELU input) + 2f (down input)                     = 10d + 4f + 4
               (SwiGLU: 2 x 2f up output + 2f silu + 2f product: 10d + 8f + 4)

plus, once per token: the ids (8), the final norm (8d + 4), the head's input 2d, and the loss's bf16 logits, their
fp32 copy and fp32 log-probabilities, 10 V bytes. A plugin adds its terms through its Config's ``memory`` method
(:class:`MemoryFormula`). Not counted: the CUDA context and allocator slack, torch.compile's workspace, what
plugins keep outside the model (retrieval's index), communication buffers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlm.model.config import ModelConfig
from rlm.plugin.base import make_config
from rlm.plugin.registry import known_plugins, parse_spec, resolve

ADAM_BYTES = 8  # two fp32 moments per parameter (torch.optim.AdamW; the plugins' row-wise Adam alike)
LOSS_BYTES_PER_LOGIT = 2 + 4 + 4  # bf16 logits, their fp32 copy and the fp32 log-softmax cross_entropy saves


@dataclass
class Parts:
    """Parameter counts and per-token activation bytes, summed over the model's components."""

    params: int = 0
    # parameters a plugin updates with a row-wise Adam (no .grad, not in AdamW): PKM's values
    row_adam: int = 0
    row_tables: int = 0  # tables under row-wise Adam (a 4-byte step each)
    act_per_token: int = 0  # bytes autograd saves per token of the batch
    notes: list[str] = field(default_factory=list)  # what the estimate leaves out or guesses, a line each


@runtime_checkable
class MemoryFormula(Protocol):
    """A plugin's Config that knows the plugin's memory; the estimate refuses a plugin whose Config does not."""

    def memory(self, mc: ModelConfig, parts: Parts) -> None:
        """Add the plugin's parameters and saved bytes per token to ``parts``, taking out those of what it
        replaces."""


def norm_bytes(d: int) -> int:
    """Saved bytes per token of rlm's RMSNorm in fp32: its input, 1/rms and the normalised input."""
    return 8 * d + 4


def _attention(mc: ModelConfig) -> tuple[int, int]:
    """Parameters and saved bytes per token of one self-attention sublayer with its norm."""
    d, hd = mc.d_model, mc.head_dim
    params = d * (mc.n_heads + 2 * mc.kv_heads) * hd + d * d + d  # qkv, proj, norm
    kv = 2 * mc.kv_heads * hd
    # norm, qkv input, qkv output (v is a view of it), rotated q and k, attention output, lse, proj input
    act = norm_bytes(d) + 2 * d + 2 * (d + kv) + 2 * (d + kv // 2) + 2 * d + 4 * mc.n_heads + 2 * d
    return params, act


def ffn_terms(mc: ModelConfig, hidden: int | None = None) -> tuple[int, int]:
    """Parameters and saved bytes per token of one dense FFN (without its norm)."""
    d, f = mc.d_model, hidden or mc.hidden
    gated = mc.ffn == "gated"
    params = d * (2 if gated else 1) * f + f * d
    act = 2 * d + (8 * f if gated else 4 * f)
    return params, act


def _base(mc: ModelConfig) -> Parts:
    """The dense model's parameters and saved bytes per token, without plugins."""
    d, V, L = mc.d_model, mc.padded_vocab, mc.n_layers
    attn_p, attn_a = _attention(mc)
    ffn_p, ffn_a = ffn_terms(mc)
    per_layer_p = attn_p + d + ffn_p  # + the FFN's norm
    per_layer_a = attn_a + norm_bytes(d) + ffn_a
    params = V * d + (0 if mc.tie_embeddings else V * d) + d + L * per_layer_p
    act = L * per_layer_a + 8 + norm_bytes(d) + 2 * d + LOSS_BYTES_PER_LOGIT * V
    return Parts(params=params, act_per_token=act)


def chosen_layers(layers: Sequence[int] | None, n_layers: int, default: Sequence[int]) -> list[int]:
    """Distinct layer indices, negative ones counted from the end (as plugins' check_layers)."""
    chosen = default if layers is None else layers
    bad = [i for i in chosen if not -n_layers <= i < n_layers]
    if bad:
        raise ValueError(
            f"layers {bad} are outside the model's {n_layers}; accepted: -{n_layers}..{n_layers - 1}"
        )
    return sorted({i % n_layers for i in chosen})


def model_config(config: dict[str, Any], vocab_size: int | None = None) -> ModelConfig:
    """The ModelConfig of a merged config: ``model.model``, its vocab from data (or ``vocab_size``)."""
    fields = dict((config.get("model") or {}).get("model") or {})
    data = config.get("data") or {}
    vocab = vocab_size or fields.get("vocab_size") or data.get("vocab_size")
    if vocab is None:
        raise ValueError(
            "the vocabulary size is unknown: set model.model.vocab_size or data.vocab_size, or pass vocab_size "
            "(50257 for GPT-2's tokenizer)"
        )
    fields["vocab_size"] = int(vocab)
    return ModelConfig(**fields)


def estimate(config: dict[str, Any], vocab_size: int | None = None) -> dict[str, Any]:
    """Parameters, optimizer state and activations of a merged config (``model``, ``data``, ``trainer``) in bytes."""
    mc = model_config(config, vocab_size)
    data = config.get("data") or {}
    B, T = int(data.get("batch_size", 8)), int(data.get("seq_len", 256))
    precision = str((config.get("trainer") or {}).get("precision", "32"))
    parts = _base(mc)
    for name, spec in ((config.get("model") or {}).get("plugins") or {}).items():
        parsed = parse_spec(name, spec)
        if parsed is None:
            continue
        cls, options = parsed
        if not issubclass(cls.Config, MemoryFormula):
            known = [n for n in known_plugins() if issubclass(resolve(n).Config, MemoryFormula)]
            raise ValueError(f"no memory formula for plugin {name!r}; plugins with one: {known}")
        make_config(cls, options).memory(mc, parts)
    dense = parts.params - parts.row_adam
    act = B * T * parts.act_per_token
    if not precision.startswith(("bf16", "16")):
        act *= 2  # fp32 matmul inputs: every bf16 term doubles, roughly
        parts.notes.append(f"precision {precision}: activations doubled from the bf16 count")
    out = {
        "params": parts.params,
        "adamw_params": dense,
        "row_adam_params": parts.row_adam,
        "param_bytes": 4 * parts.params,
        "grad_bytes": 4 * dense,
        "optimizer_bytes": ADAM_BYTES * parts.params + 4 * parts.row_tables,
        "activation_bytes": act,
        # autocast's bf16 copies of the weights it casts, kept for the step: about the AdamW parameters
        "autocast_weight_bytes": 2 * dense if precision.startswith(("bf16", "16")) else 0,
        "batch_size": B,
        "seq_len": T,
        "notes": parts.notes,
    }
    out["total_bytes"] = (
        out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"] + act + out["autocast_weight_bytes"]
    )
    return out


def format_estimate(est: dict[str, Any]) -> str:
    """A few lines of GiB for people."""
    gib = 2**30
    lines = [
        f"parameters {est['params']:,} ({est['row_adam_params']:,} under PKM's row Adam)",
        f"weights {est['param_bytes'] / gib:.2f} GiB, gradients {est['grad_bytes'] / gib:.2f} GiB, "
        f"Adam moments {est['optimizer_bytes'] / gib:.2f} GiB, autocast copies {est['autocast_weight_bytes'] / gib:.2f} GiB",
        f"activations at batch {est['batch_size']} x {est['seq_len']}: {est['activation_bytes'] / gib:.2f} GiB",
        f"total {est['total_bytes'] / gib:.2f} GiB (not counted: CUDA context, allocator slack, compile workspace)",
    ]
    return "\n".join(lines + est["notes"])


def local_processes() -> int:
    """Processes of this job on this machine, as the launcher says (torchrun's LOCAL_WORLD_SIZE, srun's
    SLURM_NTASKS_PER_NODE such as '8(x2)'); 1 when none says."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0].split(",")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_build(
    model: ModelConfig, plugins: dict[str, Any], processes: int | None = None, available: int | None = None
) -> None:
    """Refuse, before anything is allocated, a model whose fp32 copy in each local process does not fit the host's
    available memory (every rank builds the whole model before FSDP2 shards it), rather than meet the OOM killer
    partway through the init. Plugins without a memory formula count as the base model."""
    processes = local_processes() if processes is None else processes
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    plugins = {k: v for k, v in plugins.items() if v is not None}
    try:
        params = estimate({"model": {"model": asdict(model), "plugins": plugins}})["params"]
    except Exception:
        # no formula for a plugin or a setting, or options Transformer will refuse by name: count the base model
        params = _base(model).params
    need = 4 * params * processes
    if need > available:
        gib = 2**30
        raise MemoryError(
            f"building this model needs {need / gib:.1f} GiB of host memory ({params:,} fp32 parameters in each of "
            f"{processes} process(es) on this machine), and {available / gib:.1f} GiB is available: every process "
            "builds and initialises the whole model on the host before FSDP2 shards it (a meta-device build is "
            "not done yet). Use fewer processes per machine, a host with more memory, "
            "or a smaller model."
        )
