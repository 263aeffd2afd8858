"""The import graph inside fedge/ as scripts/import_graph.py reads it (type-only, deferred and by-name imports
included): no circle but through the registry's imports by name, and the arrows up are the ones the import-linter
contract in pyproject.toml names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from fedge.registry import MODULES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import_graph.py"
spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
assert spec is not None and spec.loader is not None
graph = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = graph  # its dataclass resolves its annotations through sys.modules
spec.loader.exec_module(graph)

NOT_BY_NAME = {"runtime", "deferred", "type"}
Graph = tuple[list[str], list[Any]]  # modules, import edges (import_graph.Edge)


@pytest.fixture(scope="module")
def fedge_graph() -> Graph:
    """fedge's modules and import edges (parsed once: every file of the package)."""
    return graph.edges(ROOT, "fedge")


def test_no_circle_inside_fedge_counting_type_only_and_deferred_imports(
    fedge_graph: tuple[list[str], list[Any]],
) -> None:
    nodes, found = fedge_graph
    arcs = sorted({(e.source, e.target) for e in found if e.kind in NOT_BY_NAME})
    assert graph.strongly_connected(nodes, arcs) == []


def test_only_the_registry_imports_by_name_and_only_its_algorithm_modules(
    fedge_graph: tuple[list[str], list[Any]],
) -> None:
    _, found = fedge_graph
    by_name = {(e.source, e.target) for e in found if e.kind == "by-name"}
    assert by_name == {("fedge.registry", module) for module in MODULES.values()}


def test_the_arrows_up_are_the_ones_the_import_linter_contract_names(fedge_graph: Graph) -> None:
    _, found = fedge_graph
    up = {f"{e.source} -> {e.target}" for e in graph.upward(found, graph.layers(ROOT, "fedge")) if e.kind != "by-name"}
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c.get("containers") == ["fedge"]]
    assert up == set(contract.get("ignore_imports", []))
    assert config["exclude_type_checking_imports"] is False  # lint-imports counts annotations as the graph does


def test_a_circle_closed_by_an_annotation_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    nodes, found = graph.edges(tmp_path, "pkg")
    assert {(e.source, e.target, e.kind) for e in found} == {("pkg.a", "pkg.b", "runtime"), ("pkg.b", "pkg.a", "type")}
    assert graph.strongly_connected(nodes, [(e.source, e.target) for e in found]) == [["pkg.a", "pkg.b"]]
