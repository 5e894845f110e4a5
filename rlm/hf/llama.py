"""A model without plugins and with the gated FFN as transformers' own ``LlamaForCausalLM``: the same function
(pre-norm RMSNorm, rotary, SwiGLU, grouped-query attention, no biases) under other names, with rlm's fused ``qkv``
rows [q | k | v] and ``up`` rows [gate | up] split into Llama's projections. rlm rotates the pairs
(x[i], x[i + hs/2]) as Llama's ``rotate_half`` does, so q and k rows need no permutation. The head's padded rows
(model.vocab_multiple) are cut off.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlm.model.transformer import Transformer


def llama_refusal(model: Transformer) -> str | None:
    """Why ``model`` has no LlamaForCausalLM form (None: it has one)."""
    if len(model.plugins):
        return f"it has plugins ({', '.join(model.plugins)})"
    if model.config.ffn != "gated":
        return f"its FFN is model.ffn={model.config.ffn!r} (Llama's is 'gated', SwiGLU)"
    return None


def llama_config(model: Transformer, bos: int | None, eos: int | None, pad: int | None) -> Any:
    """The LlamaConfig of ``model`` (rlm.model.config.ModelConfig field by field)."""
    from transformers import LlamaConfig

    c = model.config
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=model.blocks[0].ffn.down.in_features,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=c.init_std,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
    )


def llama_state_dict(model: Transformer) -> dict[str, Tensor]:
    """``model``'s parameters under LlamaForCausalLM's names (the tied head left out, as transformers saves it)."""
    c = model.config
    V = c.vocab_size
    q, kv = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    out = {
        "model.embed_tokens.weight": model.embed.main.table.weight[:V],
        "model.norm.weight": model.norm.weight,
    }
    if not c.tie_embeddings:
        out["lm_head.weight"] = model.head.weight[:V]
    for i, block in enumerate(model.blocks):
        pre = f"model.layers.{i}."
        wq, wk, wv = block.attn.qkv.weight.split([q, kv, kv])  # (rows, d) each
        gate, up = block.ffn.up.weight.chunk(2)  # (hidden, d) each
        out |= {
            pre + "input_layernorm.weight": block.attn_norm.weight,
            pre + "self_attn.q_proj.weight": wq,
            pre + "self_attn.k_proj.weight": wk,
            pre + "self_attn.v_proj.weight": wv,
            pre + "self_attn.o_proj.weight": block.attn.proj.weight,
            pre + "post_attention_layernorm.weight": block.ffn_norm.weight,
            pre + "mlp.gate_proj.weight": gate,
            pre + "mlp.up_proj.weight": up,
            pre + "mlp.down_proj.weight": block.ffn.down.weight,
        }
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
