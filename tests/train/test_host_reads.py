"""Host reads (each a host synchronisation on a GPU) in one training step of `rlm fit`, per plugin, pinned.

tests/host_reads.py counts them in-process during the second step: forward, backward, clipping, the optimizer step
and every callback of the step. The pinned numbers are the documented few; a change that adds a read to the step
must lower another or say why here.
"""

import json

import pytest
from cli_helpers import CONFIGS, fit_args

# plugin config -> host reads of one step. Every config has the non-finite guard's read of its record
# (rlm/train/guard.py): every step on a CPU, every log_every_n_steps steps on a GPU. The others:
# - moe: the dispatch plan's count of kept assignments (plugins/_experts.py plan), one per MoE layer;
# - pkm: the distinct value rows of the row-wise Adam (unique_consecutive) and its step count, both on the CPU's
#   EmbeddingBag path only (the CUDA gather path reads none: tests/plugins/test_pkm_gather.py);
# - retrieval: the distinct neighbour ids and distinct token ids the encoder embeds once each (torch.unique);
# - token_memory: the valid target positions its mixture and its queue keep (boolean indexing).
PINNED = {
    "dense": 1,
    "tokenid": 1,
    "moe": 2,
    "pkm": 3,
    "partial_experts": 1,
    "altup": 1,
    "retrieval": 3,
    "knn_attention": 1,
    "token_memory": 6,
}
LAYERS = {"moe": [1], "pkm": [1]}  # the shipped fragments name layers of the 4-layer default model


# slow: an in-process `rlm fit` per plugin (data, model, index where the plugin has one, 2 steps)
@pytest.mark.slow
@pytest.mark.parametrize("plugin", [*PINNED, "dense+bar"])
def test_one_training_step_reads_the_host_only_the_pinned_times(plugin, tmp_path, rlm_cache, rlm_main):
    plugin, bar = plugin.removesuffix("+bar"), plugin.endswith("+bar")
    fragments = [] if plugin == "dense" else [CONFIGS / "plugins" / f"{plugin}.yaml"]
    out = tmp_path / "reads.json"
    args = [
        *fit_args(*fragments),
        "--trainer.max_steps=2",
        "--trainer.callbacks+=host_reads.HostReads",
        f"--trainer.callbacks.out={out}",
        "--trainer.log_every_n_steps=5",  # step 1 writes no logs: the loggers read what they write at theirs
    ]
    if bar:  # the progress bar shows the loss as logged, at log_every_n_steps, not read every step
        args += ["--trainer.enable_progress_bar=true"]
    if plugin in LAYERS:
        args.append(f"--model.plugins.{plugin}.layers={LAYERS[plugin]}")
    proc = rlm_main(args, tmp_path, rlm_cache)
    assert proc.returncode == 0, proc.stderr
    reads = json.loads(out.read_text())
    print(f"\nHOSTREADS {plugin} {reads['total']} {json.dumps(reads['where'])}")
    assert reads["total"] == PINNED[plugin], reads["where"]
