"""The import graph inside a package, type-only imports included: its circles and the arrows that point up.

import-linter (``lint-imports``) checks the layer contracts on the import statements (this project counts those under
``if TYPE_CHECKING:`` too: ``exclude_type_checking_imports = false``), but a layers contract does not see a circle
between modules of one layer, nor an import by name. A circle closed by a type-only import, by an import deferred into
a function body or by one by name is still a circle of the code's design (issue 54), so this script lists every edge
with its kind (``tests/scripts/test_import_graph.py`` holds fedge to no circle but through the registry's imports by
name, and to the arrows up its contract names):

- ``runtime``: a module-level import (it runs when the module loads);
- ``deferred``: an import inside a function or method body (runs on call; often hides a circle);
- ``type``: an import under ``if TYPE_CHECKING:`` (never runs);
- ``by-name``: a string constant that names a module of the package, in a module that calls ``import_module`` (a
  registry importing its entries by name, on first use).

It prints the edge counts by kind, the strongly connected components of more than one module (circles) with all
edges and with the runtime ones only, and, for the ``[[tool.importlinter.contracts]]`` layers contract whose
container is the package, the edges between its sub-packages that point up. As import-linter does, an import of
``pkg.mod`` is an edge to ``pkg.mod`` (not to the ``pkg/__init__.py`` that Python also runs first).

    .venv/bin/python scripts/import_graph.py fedge            # summary
    .venv/bin/python scripts/import_graph.py fedge --edges    # and every edge of a circle or pointing up
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tomllib

KINDS = ("runtime", "deferred", "type", "by-name")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str
    line: int


def modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under ``root/package`` (a package's ``__init__`` is the package)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``tree`` with its kind (see the module)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, kind))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, "type" if kind == "type" else "deferred")
            else:
                visit(child, kind)

    def visit_stmt(stmt: ast.stmt, kind: str) -> None:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            found.append((stmt, kind))
        else:
            visit(stmt, kind)

    visit(tree, "runtime")
    return found


def edges(root: Path, package: str) -> tuple[list[str], list[Edge]]:
    """The package's modules and the import edges between them."""
    mods = modules(root, package)
    out: list[Edge] = []
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node, kind in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from a.b import c``: the module a.b.c when there is one, else a.b itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in dict.fromkeys(targets):
                while target and target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]  # ``import a.b.c`` of a name inside a.b
                if target in mods and target != name:
                    out.append(Edge(name, target, kind, node.lineno))
        if any(isinstance(n, ast.Name | ast.Attribute) and _name(n) == "import_module" for n in ast.walk(tree)):
            for n in ast.walk(tree):
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in mods and n.value != name:
                    out.append(Edge(name, n.value, "by-name", n.lineno))
    return list(mods), out


def _name(node: ast.Name | ast.Attribute) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr


def strongly_connected(nodes: list[str], arcs: list[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one node, each sorted."""
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in arcs:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components, key=lambda c: (-len(c), c))


def layers(root: Path, package: str) -> list[list[str]]:
    """The layers (top first; ``a | b`` is one layer) of the import-linter layers contract whose container is
    ``package``, read from ``root/pyproject.toml``; empty when there is none."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    for contract in config.get("tool", {}).get("importlinter", {}).get("contracts", []):
        if contract.get("type") == "layers" and contract.get("containers") == [package]:
            return [[f"{package}.{p.strip()}" for p in layer.split("|")] for layer in contract["layers"]]
    return []


def _layer_of(module: str, stack: list[list[str]]) -> int | None:
    for i, layer in enumerate(stack):
        if any(module == p or module.startswith(p + ".") for p in layer):
            return i
    return None


def upward(found: list[Edge], stack: list[list[str]]) -> list[Edge]:
    """Edges from a lower layer to a higher one (layers are listed top first)."""
    out = []
    for e in found:
        a, b = _layer_of(e.source, stack), _layer_of(e.target, stack)
        if a is not None and b is not None and b < a:
            out.append(e)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", help="a top-level package of the repository, e.g. fedge")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--edges", action="store_true", help="list the edges inside circles and those pointing up")
    args = parser.parse_args(argv)
    nodes, found = edges(args.root, args.package)
    counts = Counter(e.kind for e in found)
    pairs = {(e.source, e.target) for e in found}
    by_kind = ", ".join(f"{counts[k]} {k}" for k in KINDS)
    print(f"{args.package}: {len(nodes)} modules, {len(pairs)} import edges ({by_kind})")
    for label, kinds in (
        ("all imports", set(KINDS)),
        ("all but by-name imports", {"runtime", "deferred", "type"}),
        ("runtime imports only", {"runtime"}),
    ):
        arcs = sorted({(e.source, e.target) for e in found if e.kind in kinds})
        circles = strongly_connected(nodes, arcs)
        print(f"circles with {label}: {len(circles)}")
        for c in circles:
            print(f"  {len(c)} modules: {', '.join(c)}")
            if args.edges:
                inside = set(c)
                for e in found:
                    if e.kind in kinds and e.source in inside and e.target in inside:
                        print(f"    {e.source} -> {e.target} ({e.kind}, line {e.line})")
    stack = layers(args.root, args.package)
    if stack:
        up = upward(found, stack)
        up_kinds = Counter(e.kind for e in up)
        print(f"edges pointing up the layers contract: {len(up)} ({', '.join(f'{up_kinds[k]} {k}' for k in KINDS)})")
        if args.edges:
            for e in up:
                print(f"  {e.source} -> {e.target} ({e.kind}, line {e.line})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
