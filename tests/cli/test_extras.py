"""Dependencies: every imported package is declared, and a missing extra is named in the error."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlm.data.corpus import read_corpus
from rlm.experiment import report
from rlm.extras import MissingExtra, require

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"rlm", "index", "plugins"}


def _imported_top_level(paths: list[Path]) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - FIRST_PARTY - {"__future__"}


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def test_every_imported_package_is_declared():
    # The installed package: rlm/, plugins/ and index/ (benchmarks/ has its own `bench` extra).
    sources = [p for d in ("rlm", "plugins", "index") for p in (ROOT / d).rglob("*.py")]
    imported = _imported_top_level(sources)
    declared = {
        _norm(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in importlib.metadata.requires("rlm")
    }
    owners = importlib.metadata.packages_distributions()
    missing = {m: owners.get(m) for m in imported if not {_norm(d) for d in owners.get(m, [])} & declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without the package raises
    with pytest.raises(
        MissingExtra, match=r"an hf: corpus needs the 'datasets' package.*pip install 'rlm\[hf\]'"
    ):
        read_corpus("hf:some/name")


def test_plots_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"pip install 'rlm\[plots\]'"):
        report.plot(tmp_path, {"name": "x", "baseline": "base"}, [])


def test_faiss_names_both_extras():
    code = "import sys; sys.modules['faiss'] = None\nimport rlm.index.build\n"
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr
    assert "MissingExtra: retrieval indices needs the 'faiss' package" in err
    assert "pip install 'rlm[gpu]' (or pip install faiss-cpu, rlm's default)" in err


def test_require_passes_an_inner_import_error_through(monkeypatch, tmp_path):
    # The package is installed but one of its own imports fails: that error, not "install the extra".
    (tmp_path / "pkg_with_broken_dep.py").write_text("import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz") as info:
        require("pkg_with_broken_dep", "hf", "a test")
    assert not isinstance(info.value, MissingExtra)
    assert require("json", "hf", "a test").__name__ == "json"


# Names the package imports from torch modules whose public API grew recently, with the torch release that made
# them public (torch's release notes). A new import from one of these modules must be added here.
TORCH_API_SINCE = {
    "torch.distributed.fsdp": {"fully_shard": (2, 6), "FSDPModule": (2, 6), "MixedPrecisionPolicy": (2, 6)},
    "torch.distributed.tensor": {"DTensor": (2, 5)},
    "torch.distributed.device_mesh": {"DeviceMesh": (2, 2), "init_device_mesh": (2, 2)},
}


def test_torch_floor_covers_the_torch_apis_imported():
    text = (ROOT / "pyproject.toml").read_text()
    floor = tuple(int(v) for v in re.search(r'"torch>=(\d+)\.(\d+)', text).groups())
    sources = [p for d in ("rlm", "plugins", "index") for p in (ROOT / d).rglob("*.py")]
    needed = {}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in TORCH_API_SINCE:
                for alias in node.names:
                    since = TORCH_API_SINCE[node.module].get(alias.name)
                    assert since, f"{path.name} imports {node.module}.{alias.name}: add it to TORCH_API_SINCE"
                    needed[f"{node.module}.{alias.name}"] = since
    assert "torch.distributed.fsdp.fully_shard" in needed  # the scan sees the package's imports
    too_new = {name: v for name, v in needed.items() if v > floor}
    assert not too_new, f"pyproject allows torch {floor}, but these need a later release: {too_new}"


def test_a_logger_whose_package_is_missing_is_one_line_naming_the_extra(monkeypatch, rlm_main, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    (tmp_path / "wandb.yaml").write_text(
        "trainer:\n  logger:\n    - class_path: pytorch_lightning.loggers.WandbLogger\n      init_args: {project: x}\n"
    )
    r = rlm_main(
        ["fit", "--config", ROOT / "configs/model/tiny.yaml", "--config", tmp_path / "wandb.yaml"], tmp_path
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "rlm fit: error: pytorch_lightning.loggers.WandbLogger needs the 'wandb' package, which is not installed: "
        "pip install 'rlm[wandb]'"
    ]
    r = rlm_main(["fit", "--trainer.logger=WandbLogger"], tmp_path)
    assert r.returncode == 2 and "needs the 'wandb' package" in r.stderr
