"""The README's code runs as written: the plugin example of "Adding a plugin"."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from rlm.model import ModelConfig, Transformer

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_block(section: str) -> str:
    text = README.read_text()
    body = text[text.index(f"## {section}") :]
    return re.search(r"```python\n(.*?)```", body, flags=re.S).group(1)


def test_the_plugin_example_builds_and_scales_the_ffn(tmp_path, monkeypatch):
    """The example plugin, saved as a module, loads by class_path; with scale s at layer 1 the logits equal those of
    the plain model whose layer-1 FFN output projection is multiplied by s (the FFN is linear in it)."""
    (tmp_path / "readme_scale.py").write_text(_python_block("Adding a plugin"))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    torch.manual_seed(0)
    plain = Transformer(config)
    torch.manual_seed(0)
    spec = {"class_path": "readme_scale.ScalePlugin", "init_args": {"layers": [1], "init": 1.0}}
    scaled = Transformer(config, {"scale": spec})
    assert type(scaled.blocks[1].ffn).__name__ == "Scaled" and type(scaled.blocks[0].ffn).__name__ != "Scaled"
    assert scaled.added_parameters() == 1
    tokens = torch.randint(0, 64, (2, 16))
    plain.eval(), scaled.eval()
    with torch.no_grad():
        torch.testing.assert_close(scaled(tokens), plain(tokens))  # init 1: the same model
        scaled.blocks[1].ffn.scale.fill_(2.5)
        plain.blocks[1].ffn.down.weight.mul_(2.5)
        torch.testing.assert_close(scaled(tokens), plain(tokens))
    sys.modules.pop("readme_scale", None)


def _fit_commands(section: str) -> list[list[str]]:
    """The `rlm fit` commands of a README section's bash blocks (after torchrun's `-m rlm` or srun's path too),
    continuation lines joined and comments dropped: the arguments after `fit`."""
    import shlex

    text = README.read_text()
    body = text[text.index(f"## {section}") :]
    body = body[: body.index("\n## ", 1)]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words[:-1]):
                if (word == "rlm" or word.endswith("/rlm")) and words[i + 1] == "fit":
                    commands.append(words[i + 2 :])
    return commands


GPU_SECTIONS = ("On a GPU", "Multi-GPU and multi-node")


def test_every_fit_command_of_the_gpu_sections_parses(tmp_path, rlm_main):
    """Each `rlm fit` of README's GPU and multi-GPU sections, as printed, gives its config (--print_config) on this
    CPU: the files and options it names exist. GPT-2's tokenizer file, which the user downloads, is stood in for
    by a byte-level BPE of the same vocabulary size."""
    tokenizers = __import__("pytest").importorskip("tokenizers")
    commands = [c for s in GPU_SECTIONS for c in _fit_commands(s)]
    assert len(commands) >= 5, commands  # gpt2 small, ddp, fsdp, fsdp on a CPU, torchrun, srun
    (tmp_path / "configs").symlink_to(README.parent / "configs")
    (tmp_path / "gpt2").mkdir()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.add_tokens([f"t{i}" for i in range(50256)])
    bpe.add_special_tokens(["<|endoftext|>"])  # GPT-2's one special token, id 50256
    bpe.save(str(tmp_path / "gpt2" / "tokenizer.json"))
    for args in commands:
        proc = rlm_main(["fit", *args, "--print_config"], tmp_path)
        assert proc.returncode == 0, f"rlm fit {' '.join(args)}\n{proc.stderr}"
        assert "trainer:" in proc.stdout
