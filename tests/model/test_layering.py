"""Import layering (README, "Layout"): every import statement of rlm/, index/ and plugins/, at module level,
inside a function or under TYPE_CHECKING, read with ast (plus ``importlib.import_module("literal")``).

- rlm/ never imports a concrete plugin (rlm.plugins.*): the registry names them in strings only;
- index/ never imports rlm.plugins;
- rlm.plugins never imports Lightning's strategies (a plugin asks rlm.distributed.layout what the run is);
- no module imports a layer above its own (LAYERS, lowest first);
- no import cycle among the modules, lazy imports included (KNOWN_CYCLES excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"rlm": ROOT / "rlm", "rlm.plugins": ROOT / "plugins", "rlm.index": ROOT / "index"}

# Lowest first; a module belongs to the layer of its longest matching prefix, and may import its own layer
# and the ones below. "rlm" alone catches the top-level modules (rlm/__init__.py, extras).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("rlm", "rlm.model", "rlm.data", "rlm.plugin")),
    ("index and parallelism", ("rlm.index", "rlm.distributed")),
    ("plugins", ("rlm.plugins",)),
    ("train", ("rlm.train",)),
    ("eval", ("rlm.eval", "rlm.hf.export")),
    (
        "cli plumbing",
        (
            "rlm.cli.check",
            "rlm.cli.support",
            "rlm.cli.summary",
            "rlm.cli.lightning_cli",
        ),
    ),  # fmt: skip
    ("subcommands", ("rlm.experiment", "rlm.index.cli")),
    ("entry points", ("rlm.__main__", "rlm.cli", "rlm.cli.commands")),
]

# None left.
KNOWN_CYCLES: list[list[str]] = []


def find_modules() -> dict[str, Path]:
    """Every module of rlm, rlm.plugins and rlm.index by dotted name (a package by its own name)."""
    found = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _owner(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` (a module, or a name inside one) starts with."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(name: str, path: Path) -> set[str]:
    """The dotted names the module's import statements reach, wherever they stand in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".rstrip(".")
            out.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, or a name in base
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of rlm, rlm.plugins and rlm.index it imports."""
    modules = find_modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        targets = {_owner(n, known) for n in imported_names(name, path) if n.split(".")[0] == "rlm"}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def layer(name: str) -> int:
    """Index in LAYERS of the module's layer (its longest matching prefix)."""
    best, rank = -1, 0
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_rlm_and_index_never_import_a_concrete_plugin(graph):
    bad = [
        f"{src} imports {dst}"
        for src, targets in sorted(graph.items())
        if not src.startswith("rlm.plugins")
        for dst in sorted(targets)
        if dst == "rlm.plugins" or dst.startswith("rlm.plugins.")
    ]
    assert not bad, "rlm/ and index/ reach plugins by name only (rlm.plugin.registry):\n  " + "\n  ".join(bad)


LIGHTNING_STRATEGIES = (
    "pytorch_lightning.strategies",
    "lightning.pytorch.strategies",
    "lightning.fabric.strategies",
)


def test_plugins_never_import_lightnings_strategies():
    bad = [
        f"{name} imports {target}"
        for name, path in sorted(find_modules().items())
        if name.startswith("rlm.plugins")
        for target in sorted(imported_names(name, path))
        if target.startswith(LIGHTNING_STRATEGIES)
    ]
    assert not bad, (
        "plugins read the run's layout from rlm.distributed.layout.layout(trainer):\n  " + "\n  ".join(bad)
    )


def test_no_module_imports_a_layer_above_its_own(graph):
    bad = [
        f"{src} ({LAYERS[layer(src)][0]}) imports {dst} ({LAYERS[layer(dst)][0]})"
        for src, targets in sorted(graph.items())
        for dst in sorted(targets)
        if layer(dst) > layer(src)
    ]
    order = " < ".join(name for name, _ in LAYERS)
    assert not bad, f"imports against the layer order {order}:\n  " + "\n  ".join(bad)


def test_no_import_cycles(graph):
    found = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not found, "modules that import each other (lazy imports count):\n  " + "\n  ".join(
        " <-> ".join(c) for c in found
    )


def test_every_module_is_parsed_and_the_checks_see_something(graph):
    assert "rlm.train.module" in graph and "rlm.plugins.moe" in graph and "rlm.index.sharded" in graph
    assert "rlm.model.config" in graph["rlm.train.module"]  # module-level import
    assert "rlm.train.checkpoint" in graph["rlm.train.module"]  # function-level import
    assert "rlm.cli.commands" in graph["rlm.cli"]  # importlib.import_module("rlm.cli.commands")


def test_the_checks_catch_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer("rlm.model.transformer") < layer("rlm.train.module") < layer("rlm.eval.generate")
    assert layer("rlm.eval.evaluate") < layer("rlm.cli.check") < layer("rlm.cli.commands")
    assert layer("rlm.distributed.parallel") < layer("rlm.plugins.moe") < layer("rlm.train.resume")
    assert layer("rlm.cli.support") < layer("rlm.experiment.spec") < layer("rlm.cli")
