"""``rlm export --ckpt CKPT --out DIR``: a checkpoint as a folder that plain transformers loads (docs/CLI.md).

A model without plugins and with the gated FFN is written as ``LlamaForCausalLM``; any other as rlm.hf.model's,
with rlm's source in ``rlm_src/`` for ``trust_remote_code=True`` and a retriever's index in ``index/``. Both hold
the checkpoint's tokenizer, a model card and ``manifest.json``.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlm.data.carried import data_settings, tokenizer_file
from rlm.data.pretrained import HF_FILES, is_sentencepiece, load_tokenizer
from rlm.extras import require
from rlm.index.memory import copy_memory
from rlm.index.store import atomic_dir
from rlm.model.transformer import Transformer
from rlm.outdir import claim_out_dir

SP_FILE = "tokenizer.model"
HF_JSON = "tokenizer.json"
AUTO_CONFIG, AUTO_MODEL = "modeling_rlm.RLMConfig", "modeling_rlm.RLMForCausalLM"
KNNLM_NOTE = (
    "kNN-LM datastores (`rlm knnlm build`) are not part of the export: build one from the original checkpoint "
    "with rlm."
)


# A model without plugins and with the gated FFN is transformers' own LlamaForCausalLM: the same function (pre-norm
# RMSNorm, rotary, SwiGLU, grouped-query attention, no biases) under other names, with rlm's fused qkv rows
# [q | k | v] and up rows [gate | up] split into Llama's projections. rlm rotates the pairs (x[i], x[i + hs/2]) as
# Llama's rotate_half does, so q and k rows need no permutation. The head's padded rows (model.vocab_multiple) go.
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


def write_tokenizer(ckpt: dict[str, Any], ckpt_path: Path, dest: Path) -> tuple[str, Any]:
    """Write the checkpoint's own tokenizer into ``dest`` (a Hugging Face one with a tokenizer_config.json, which
    AutoTokenizer needs); returns (what was written, the loaded tokenizer)."""
    source = Path(tokenizer_file(ckpt, ckpt_path, data_settings(ckpt, ckpt_path)))
    if is_sentencepiece(source):
        shutil.copyfile(source, dest / SP_FILE)
        return f"{SP_FILE} (sentencepiece)", load_tokenizer(str(dest / SP_FILE))
    folder = source if source.is_dir() else source.parent  # tokenizer.json, or the folder that holds it
    names = [n for n in HF_FILES if (folder / n).is_file()]
    for name in names:
        shutil.copyfile(folder / name, dest / name)
    tok = load_tokenizer(str(dest / HF_JSON))
    if "tokenizer_config.json" not in names:
        from tokenizers import Tokenizer as HFTokenizers

        raw = HFTokenizers.from_file(str(dest / HF_JSON))
        specials = {
            f"{kind}_token": raw.id_to_token(getattr(tok, f"{kind}_id")) for kind in ("bos", "eos", "pad")
        }
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
        (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        names.append("tokenizer_config.json")
    return ", ".join(names), tok


def export_indices(model: Transformer, dest: Path, say: Callable[[str], None]) -> dict[str, str | None]:
    """Copy every index a plugin's extra state names (``{'index_dir': path}``) under ``dest``; returns plugin
    label -> folder relative to ``dest``, or None where there is none to export."""
    owners = {}
    for label, plugin in model.plugins.items():
        if type(plugin).get_extra_state is not nn.Module.get_extra_state:
            state = plugin.get_extra_state()
            if isinstance(state, dict) and "index_dir" in state:
                owners[label] = state["index_dir"]
    found: dict[str, str | None] = {}
    for label, path in owners.items():
        rel = "index" if len(owners) == 1 else f"index/{label}"
        if path is None:
            say(
                f"plugin {label!r} has no index (none was built before this checkpoint): exported without one"
            )
        elif not Path(path).is_dir():
            say(f"plugin {label!r}: its index {path} is gone: exported without one")
            path = None
        else:
            try:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                meta = copy_memory(path, dest / rel)
                say(f"plugin {label!r}: copied its index ({meta['count']} segments) from {path} to {rel}/")
            except (ValueError, FileNotFoundError) as err:
                say(f"plugin {label!r}: its index {path} cannot be exported ({err}): exported without one")
                shutil.rmtree(dest / rel, ignore_errors=True)
                path = None
        found[label] = rel if path is not None else None
    return found


def final_metrics(ckpt_path: Path, step: int) -> tuple[Path | None, dict[str, tuple[int, float]]]:
    """The run's metrics.csv beside the checkpoint (or None) and each loss column's last (step, value) to ``step``."""
    run = ckpt_path.resolve().parent.parent
    versions = sorted(run.glob("version_*/metrics.csv"), key=lambda p: p.stat().st_mtime, reverse=True)
    candidates = [ckpt_path.resolve().parent / "metrics.csv", run / "metrics.csv", *versions]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        return None, {}
    last: dict[str, tuple[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            at = int(float(row.get("step") or 0))
            if at > step:
                continue
            for name, value in row.items():
                if name and "loss" in name and value not in (None, ""):
                    last[name] = (at, float(value))
    return path, last


def _block(obj: Any) -> str:
    """``obj`` as a fenced JSON block of the card."""
    return "```json\n" + json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n```"


def card(
    ckpt: dict[str, Any],
    ckpt_path: Path,
    config: Any,
    tokenizer: str,
    indices: dict[str, str | None],
    not_llama: str | None,
) -> str:
    """The README.md of the exported folder; ``not_llama``: why it is not a LlamaForCausalLM (None: it is one)."""
    hp = ckpt.get("hyper_parameters") or {}
    data = {k: v for k, v in (ckpt.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")}
    step = int(ckpt.get("global_step", 0))
    metrics_file, losses = final_metrics(ckpt_path, step)
    lines = [
        "---",
        "library_name: transformers",
        "tags: [rlm]",
        "---",
        f"# {ckpt_path.stem}: an rlm model",
        "",
        f"Exported by `rlm export` from `{ckpt_path}` at step {step} (epoch {ckpt.get('epoch', '?')}).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(DIR"
        + (")" if not_llama is None else ", trust_remote_code=True)"),
        "```",
        "",
        "A LlamaForCausalLM: plain transformers loads it and generates with its own key/value cache."
        if not_llama is None
        else f"Not a LlamaForCausalLM, as {not_llama}: the folder carries rlm's own source (`rlm_src/`), which "
        "`modeling_rlm.py` loads, so it needs no rlm installed (where rlm is installed, `import rlm.hf` "
        "registers it without trust_remote_code). generate() uses rlm's key/value cache (or recomputes "
        "the window with use_cache=False).",
        "",
        f"Tokenizer: {tokenizer} (load it with `rlm.data.pretrained.load_tokenizer(DIR/<file>)`; documents "
        "are framed as [bos] + ids + [eos]).",
        "",
        "## Training",
        "",
        f"- steps: {step}",
    ]
    if losses:
        lines.append(f"- final losses (the last logged value up to step {step}, from `{metrics_file}`):")
        lines += [f"  - {name}: {value:.4f} (step {at})" for name, (at, value) in sorted(losses.items())]
    else:
        lines.append("- final losses: no metrics.csv was found beside the checkpoint")
    for cb, state in (ckpt.get("callbacks") or {}).items():
        if isinstance(state, dict) and state.get("best_model_score") is not None:
            lines.append(
                f"- {str(cb).split('{')[0]} {state.get('monitor')}: best {float(state['best_model_score']):.4f}"
            )
    lines += ["", "Model:", "", _block(hp.get("model") or {}), "", "Optimizer:", "",
              _block(hp.get("optim") or {}), "", "## Data", "", _block(data) if data else "(no data settings)", ""]  # fmt: skip
    plugins = getattr(config, "plugins", None)
    lines += ["## Plugins", "", _block(plugins) if plugins else "None: the base transformer.", "", "## Retrieval",
              ""]  # fmt: skip
    for label, rel in indices.items():
        found = f"its index is in `{rel}/`, searched online with rlm's faiss code."
        lines.append(f"- plugin `{label}`: " + (found if rel else "no index was exported (it had none); it runs "
                                                 "without neighbours."))  # fmt: skip
    if not indices:
        lines.append("- no retriever.")
    lines += [f"- {KNNLM_NOTE}", ""]
    return "\n".join(lines)


def write_source(dest: Path) -> None:
    """rlm's own source (its packages' .py and .c files) under ``dest/rlm_src/rlm``, and the remote-code entry
    ``dest/modeling_rlm.py`` (rlm.hf.modeling_rlm) that loads the model from it."""
    from importlib.util import find_spec

    def folder(name: str) -> Path:  # found, not imported: the core never imports a plugin
        return Path(find_spec(name).submodule_search_locations[0])

    root = dest / "rlm_src" / "rlm"
    sources = {"rlm": root, "rlm.plugins": root / "plugins", "rlm.index": root / "index"}
    for name, target in sources.items():
        base = folder(name)
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(base)
            nested = name == "rlm" and rel.parts[0] in ("plugins", "index")  # (not where they are installed)
            if path.suffix in (".py", ".c", ".typed") and "__pycache__" not in rel.parts and not nested:
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target / rel)
    shutil.copyfile(Path(__file__).with_name("modeling_rlm.py"), dest / "modeling_rlm.py")


def write_rlm(
    model: Transformer, module: Any, tok: Any, dest: Path, say: Callable[[str], None]
) -> tuple[Any, dict[str, str | None]]:
    """Write ``model`` into ``dest`` as rlm.hf.model's, with its source and indices; returns (config, indices)."""
    from rlm.hf.model import RLMConfig, RLMForCausalLM, plugin_specs

    indices = export_indices(model, dest, say)
    specs = plugin_specs(model)
    # index_dir says where training writes rebuilds: meaningless on another machine
    for label in indices:
        if "index_dir" in specs[label]["init_args"]:
            specs[label]["init_args"]["index_dir"] = None
    config = RLMConfig(
        rlm_model=asdict(module.model_config),
        plugins=specs,
        indices=indices,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    config.auto_map = {"AutoConfig": AUTO_CONFIG, "AutoModelForCausalLM": AUTO_MODEL}
    config.name_or_path = str(dest)  # where the copied indices are (not written to config.json)
    # a shell built from config.json alone must have the checkpoint's parameters; its Transformer goes in
    with torch.device("meta"):
        hf = RLMForCausalLM(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    got = {k: tuple(v.shape) for k, v in hf.model.state_dict().items() if isinstance(v, torch.Tensor)}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:5]
        raise ValueError(
            f"the exported config does not rebuild the checkpoint's model; first differences: {diff}"
        )
    hf.model = model
    hf.save_pretrained(dest)
    write_source(dest)
    return config, indices


def export(
    ckpt_path: str | Path, out: str | Path, force: bool = False, say: Callable[[str], None] = print
) -> Path:
    """Write the exported folder of a checkpoint at ``out`` (see the module docstring)."""
    require("transformers", "hf-export", "rlm export")
    require("safetensors", "hf-export", "rlm export")
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from rlm.hf.model import write_manifest
    from rlm.train.checkpoint import load_checkpoint_file
    from rlm.train.module import LMModule

    ckpt_path = Path(ckpt_path)
    dest = claim_out_dir(out, reads=[ckpt_path], force=force)  # before the checkpoint is read
    ckpt = load_checkpoint_file(ckpt_path)  # a missing or damaged file is a one-line error naming it
    if "hyper_parameters" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{str(ckpt_path)!r} is not a checkpoint of rlm fit (it holds no model settings)")
    module = LMModule.load_from_checkpoint(ckpt_path, map_location="cpu")
    model = module.model.eval()
    llama = llama_refusal(model)
    with atomic_dir(dest) as tmp:
        tokenizer, tok = write_tokenizer(ckpt, ckpt_path, tmp)
        if tok.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tok.vocab_size} ids but the model only {model.config.vocab_size}"
            )
        if llama is None:  # transformers' own LlamaForCausalLM
            config = llama_config(model, tok.bos_id, tok.eos_id, tok.pad_id)
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            save_file(llama_state_dict(model), tmp / "model.safetensors", metadata={"format": "pt"})
            indices: dict[str, str | None] = {}
        else:
            config, indices = write_rlm(model, module, tok, tmp, say)
        for path in tmp.iterdir():  # safetensors writes its file private; the folder is to be shared
            if path.is_file():
                path.chmod(0o644)
        (tmp / "README.md").write_text(card(ckpt, ckpt_path, config, tokenizer, indices, llama))
        write_manifest(tmp, indices)  # last: it covers the card and the tokenizer too
    kind = "LlamaForCausalLM" if llama is None else f"rlm's own code (trust_remote_code=True), as {llama}"
    say(f"exported as {kind}")
    say(f"wrote {out}: model.safetensors, config.json, {tokenizer}, README.md")
    say(KNNLM_NOTE)
    return dest
