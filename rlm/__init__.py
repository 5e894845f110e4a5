"""rlm: retrieval-augmented language models with memory plugins.

The packages, lowest first; each imports only its own layer and the ones below, lazy imports included, and no
two modules import each other (tests/model/test_layering.py, which names the one pair left in index/; the map is in
the README, "Layout"):

1. core: rlm.model, rlm.data, rlm.plugin (the contract and a registry that names plugins as strings), rlm.extras
2. rlm.index (index/) and rlm.distributed (FSDP2 helpers, gradients rlm reduces itself)
3. rlm.plugins (plugins/): core, rlm.index and rlm.distributed; rlm/ and index/ never import a plugin
4. rlm.train, then 5. rlm.eval
6. rlm.cli's config plumbing (merge, override, check, support, lightning_cli)
7. rlm.experiment and rlm.index.cli, the subcommands with parsers of their own
8. rlm.cli.commands, the command table (``rlm``), with rlm.cli and rlm.__main__
"""

__version__ = "0.1.0"
