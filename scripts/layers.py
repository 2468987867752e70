#!/usr/bin/env python3
"""The layers of the ``agentic_lora`` package, and the imports that go upward through them.

Each module of ``agentic_lora/`` belongs to one layer (the longest prefix below names it). A module
may import from its own layer and from the layers below it; an import of a higher layer is an
*upward* import. Plugins (``plugins/``) and routers (``routers/``) sit outside, above every layer:
they may use the package, and the package never imports them (it finds them by entry point).

Two numbers are kept: upward imports that run (they can make import cycles and drag a surface
into the core) and upward imports made only for type checking (inside ``if TYPE_CHECKING:``, such
as a ``from_settings`` constructor naming the settings type). ``tests/kit/test_layers.py`` fails when
either grows above the number recorded here; lower a recorded number when an import goes away.

It also finds import cycles: modules that import each other, directly or through others, counting
every import (at the top, inside a function, or for type checking only). A cycle inside a layer
breaks no layer rule, yet it means neither module can be read, tested or changed without the
other; the fix is a design that needs no cycle (a Protocol declared where it is used, a third
module that knows both). None is recorded.

Run ``python scripts/layers.py`` to print the layers, every upward import and every cycle (exit
status 1 when a count is above its record, or a module belongs to no layer).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "agentic_lora"

#: Bottom first. A layer is (name, what it holds, the module prefixes in it).
LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "foundation",
        "typed errors, identities and value types, I/O-free helpers, the plugin loader",
        ("errors", "foundation"),
    ),
    ("adapters", "adapter snapshots, validation and the on-disk store", ("adapters",)),
    (
        "registry",
        "the registry state machine, its journal and clients (local, Ray); reply provenance",
        ("registry",),
    ),
    (
        "engines",
        "engine dialects, the engine HTTP layer, backends' and routers' contracts; the fleet "
        "model (plain engines, PD groups)",
        ("engines",),
    ),
    ("leases", "owner leases held against the registry", ("leases",)),
    ("config", "settings, flags and the start-up engine checks", ("config",)),
    ("session", "Sessions, the dispatch middleware and streams", ("session",)),
    ("publication", "publisher, reclaimer, repairer and resolver", ("publication",)),
    ("assembly", "a Deployment built from settings, and its metrics", ("assembly",)),
    ("surface", "the HTTP gateway and the command line", ("gateway", "cli")),
    ("kit", "the package's public names and the test kit", ("__init__", "testing")),
)

#: Upward imports that run, as of the last change that moved one.
RECORDED_UPWARD = 0
#: Upward imports made only for type checking (``if TYPE_CHECKING:``).
RECORDED_UPWARD_TYPING = 0
#: Import cycles between package modules (any import kind).
RECORDED_CYCLES = 0


@dataclass(frozen=True)
class Import:
    """One import of a package module by another."""

    importer: str
    imported: str
    line: int
    typing_only: bool


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer (None: no layer names it)."""
    local = module.removeprefix(PACKAGE + ".") if module != PACKAGE else "__init__"
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, _, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            named = local == prefix or local.startswith(prefix + ".")
            if named and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, importer: str, is_package: bool, known: set[str]) -> list[Import]:
    # Lines inside an ``if TYPE_CHECKING:`` body (not its else): imports there never run.
    typing_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                typing_lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = importer if is_package else importer.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            # ``from agentic_lora import store`` imports the module, not the package.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        typing_only = node.lineno in typing_lines
        found += [Import(importer, target, node.lineno, typing_only) for target in targets]
    return sorted(found, key=lambda i: (i.line, i.imported))


def package_imports(root: Path = ROOT) -> list[Import]:
    """Every import one ``agentic_lora`` module makes of another or of a plugin or router."""
    files = sorted((root / PACKAGE).rglob("*.py"))
    known = {module_name(f, root) for f in files}
    outside = {
        p.name
        for folder in ("plugins", "routers")
        if (root / folder).is_dir()
        for p in (root / folder).iterdir()
        if p.is_dir()
    }
    result: list[Import] = []
    for path in files:
        importer = module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for imp in _imports(tree, importer, path.name == "__init__.py", known):
            top = imp.imported.partition(".")[0]
            if top == PACKAGE or top in outside:
                result.append(imp)
    return result


def upward(imports: list[Import]) -> tuple[list[Import], list[str]]:
    """The upward imports, and the modules that belong to no layer."""
    up: list[Import] = []
    unplaced: set[str] = set()
    for imp in imports:
        low = layer_of(imp.importer)
        if low is None:
            unplaced.add(imp.importer)
            continue
        if imp.imported.partition(".")[0] != PACKAGE:
            up.append(imp)  # a plugin or router, above every layer
            continue
        high = layer_of(imp.imported)
        if high is None:
            unplaced.add(imp.imported)
        elif high > low:
            up.append(imp)
    return up, sorted(unplaced)


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """Every set of package modules that import each other (directly or through others), each
    sorted, in sorted order: the strongly connected components with more than one module."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.imported.partition(".")[0] == PACKAGE and imp.imported != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.imported)
    # Tarjan's algorithm, iterative (a deep package must not hit the recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


def main() -> int:
    imports = package_imports()
    up, unplaced = upward(imports)
    for index, (name, what, prefixes) in reversed(list(enumerate(LAYERS))):
        print(f"{index:2} {name:12} {what}: {', '.join(prefixes)}")
    print()
    for imp in up:
        kind = "typing" if imp.typing_only else "runs"
        print(f"upward ({kind}): {imp.importer}:{imp.line} imports {imp.imported}")
    for module in unplaced:
        print(f"in no layer: {module}")
    cycles = import_cycles(imports)
    for cycle in cycles:
        print(f"import cycle: {' <-> '.join(cycle)}")
    running = sum(not i.typing_only for i in up)
    typing_only = len(up) - running
    print(
        f"{running} upward imports that run (recorded {RECORDED_UPWARD}), "
        f"{typing_only} for type checking only (recorded {RECORDED_UPWARD_TYPING})"
    )
    print(f"{len(cycles)} import cycles (recorded {RECORDED_CYCLES})")
    over = (
        running > RECORDED_UPWARD
        or typing_only > RECORDED_UPWARD_TYPING
        or len(cycles) > RECORDED_CYCLES
    )
    return 1 if over or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
