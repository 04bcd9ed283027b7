"""No two rlcore modules import each other, directly or through others.

Every import counts, at module level or inside a function (an import inside a function is a
cycle that waits for the first call), except those under ``if TYPE_CHECKING:``. ``from a.b import
c`` is an edge to ``a.b.c`` where that is a module, else to ``a.b`` (a module importing a sibling
module through its package does not depend on the package's ``__init__``).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = {"rlcore": os.path.join(ROOT, "core"), "rlcore.plugins": os.path.join(ROOT, "plugins")}


def modules() -> dict[str, str]:
    """``{dotted name: file}`` of every module of core/ and plugins/."""
    found = {}
    for package, folder in PACKAGES.items():
        for directory, _, files in os.walk(folder):
            for name in files:
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(directory, name), folder)[:-3].replace(os.sep, ".")
                rel = rel[:-len("__init__")].rstrip(".") if rel.endswith("__init__") else rel
                found[package + ("." + rel if rel else "")] = os.path.join(directory, name)
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: str, known: set[str]) -> set[str]:
    """The rlcore modules the file at ``path`` imports anywhere but under ``if TYPE_CHECKING:``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skipped = {id(n) for top in ast.walk(tree) if _type_checking(top) for n in ast.walk(top)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            names = [a for a in node.names if f"{node.module}.{a.name}" not in known]
            out |= subs | ({node.module} if names else set())
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    graph = {}
    for name, path in found.items():
        graph[name] = imports(path, known) - {name}
    return graph


def test_no_rlcore_module_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, "import cycles among rlcore modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


#: The core: the trainer and the start-up checks. The demo is a preset applied where presets are
#: applied (the command line, :mod:`rlcore.cli`); the core knows nothing of it.
CORE = ("rlcore.trainer", "rlcore.preflight", "rlcore.plugin_checks")


def test_the_core_does_not_import_the_demo():
    found = modules()
    known = set(found)
    core = [name for name in found if any(name == c or name.startswith(c + ".") for c in CORE)]
    assert "rlcore.trainer.components" in core and "rlcore.preflight" in core
    importers = sorted(name for name in core if "rlcore.demo" in imports(found[name], known))
    assert not importers, f"core modules importing rlcore.demo: {importers}"
